"""Training of the `ref` reference character: procedural data (dataset.py), the VAE (train_vae.py),
the causal DiT (train_dit.py) and the `vivant train ref` command (cli.py). See docs/reference_model.md."""
