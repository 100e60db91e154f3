"""The quality gate (`vivant eval`): the lip-sync proxy and image metrics of the served engine against the
reference path. May import `vivant.worker.model`, `.stream` and `.train`. See docs/reference_model.md."""
