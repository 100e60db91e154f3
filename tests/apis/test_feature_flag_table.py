"""The flag table (`vivant.apis.feature_flags.FLAGS`) is the one place a flag is defined.

Shown: every row reaches the three derived models (WorkerPool `spec.flags`, CharacterSession
`spec.flags` overrides, the Redis `FlagValues`) and both CRDs with its type and default; a table with
an added flag yields that flag everywhere without other edits; a malformed row is refused with the flag
named; the derived models keep their trust-boundary behaviour (CRD input strict, Redis input tolerant);
and `SessionPhase` is one definition shared by the CRD's status and the worker's Redis reports.
"""

from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError
from vivant.apis import crdgen, resources
from vivant.apis import feature_flags as ff
from vivant.sessions.models import FlagSet, SessionStats

JSON_TYPE = {bool: "boolean", int: "integer", str: "string"}


def _crd_flags(crd: dict) -> dict:
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema["properties"]["spec"]["properties"]["flags"]["properties"]


@pytest.mark.parametrize("flag", ff.FLAGS, ids=lambda f: f.name)
def test_every_row_reaches_the_three_models_and_both_crds(flag: ff.Flag) -> None:
    pool = ff.PoolFlags.model_fields[flag.name]
    assert (pool.annotation, pool.default, pool.description) == (flag.type, flag.default, flag.description)
    values = ff.FlagValues.model_fields[flag.name]
    assert (values.annotation, values.default) == (flag.type, flag.default)
    override = ff.FlagOverrides.model_fields[flag.name]
    assert override.annotation == flag.type | None and override.default is None
    assert ff.KNOWN_FLAGS[flag.name] is flag.type

    in_pool_crd = _crd_flags(crdgen.pool_crd())[flag.name]
    assert (in_pool_crd["type"], in_pool_crd["default"]) == (JSON_TYPE[flag.type], flag.default), in_pool_crd
    assert _crd_flags(crdgen.session_crd())[flag.name] == {"type": JSON_TYPE[flag.type]}


def test_the_models_hold_exactly_the_table() -> None:
    names = [f.name for f in ff.FLAGS]
    for model in (ff.PoolFlags, ff.FlagOverrides, ff.FlagValues):
        assert list(model.model_fields) == names, f"{model.__name__}: {list(model.model_fields)} != {names}"
    assert list(_crd_flags(crdgen.pool_crd())) == names


def test_an_added_row_appears_everywhere() -> None:
    table = (*ff.FLAGS,
             ff.Flag(name="decoderStreams", type=int, default=2, description="CUDA streams of the decoder."),
             ff.Flag(name="attnBackend", type=str, default="image", description="Attention backend name."))
    pool, overrides, values = ff.flag_models(table)
    schema = crdgen.to_structural(pool)["properties"]
    assert schema["decoderStreams"] == {"default": 2, "description": "CUDA streams of the decoder.", "type": "integer"}
    assert schema["attnBackend"]["type"] == "string" and schema["attnBackend"]["default"] == "image"
    assert crdgen.to_structural(overrides)["properties"]["decoderStreams"] == {"type": "integer"}
    stored = values.model_validate({"decoderStreams": 4})
    assert (stored.decoderStreams, stored.attnBackend) == (4, "image")
    with pytest.raises(ValidationError, match="decoderStreams"):
        pool.model_validate({"decoderStreams": "4"})  # spec input is strict: no coercion


@pytest.mark.parametrize(("row", "message"), [
    (dict(name="fused_gemm", type=bool, default=False, description="x"), "'fused_gemm': expected lowerCamelCase"),
    (dict(name="copy", type=bool, default=False, description="x"), "'copy': clashes with a pydantic"),
    (dict(name="workers", type=float, default=1.0, description="x"), "'workers': type must be bool, int or str"),
    (dict(name="workers", type=int, default=True, description="x"), "'workers': default True is a bool, expected int"),
    (dict(name="fast", type=bool, default="no", description="x"), "'fast': default 'no' is a str, expected bool"),
    (dict(name="fast", type=bool, default=False, description=" "), "'fast': description must say"),
])
def test_a_malformed_row_is_refused_with_the_flag_named(row: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ff.Flag(**row)


def test_duplicate_names_are_refused() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        ff.flag_models((*ff.FLAGS, *ff.FLAGS))


def test_spec_models_are_strict_and_the_stored_model_is_tolerant() -> None:
    with pytest.raises(ValidationError, match="warp"):
        ff.PoolFlags.model_validate({ff.FUSED_GEMM_ALL_REDUCE: True, "warp": True})
    with pytest.raises(ValidationError, match=ff.FUSED_GEMM_ALL_REDUCE):
        ff.FlagOverrides.model_validate({ff.FUSED_GEMM_ALL_REDUCE: "yes"})
    assert ff.FlagOverrides().model_dump(exclude_none=True) == {}
    stored = ff.FlagValues.model_validate({ff.FUSED_GEMM_ALL_REDUCE: True, "someFutureFlag": 3})
    assert stored.model_dump() == {ff.FUSED_GEMM_ALL_REDUCE: True}
    with pytest.raises(ValidationError, match="frozen"):
        stored.fusedGemmAllReduce = False
    fs = FlagSet(pool="ns/p", version=1, values=stored)
    assert fs.with_overrides({ff.FUSED_GEMM_ALL_REDUCE: "false"}).model_dump() == {ff.FUSED_GEMM_ALL_REDUCE: False}


def test_validate_flag_updates_names_the_flag() -> None:
    with pytest.raises(ff.FlagError, match="unknown flag\\(s\\) 'nope'; known flags: fusedGemmAllReduce"):
        ff.validate_flag_updates({"nope": True})
    with pytest.raises(ff.FlagError, match="flag 'fusedGemmAllReduce': expected bool, got 'perhaps'"):
        ff.validate_flag_updates({"fusedGemmAllReduce": "perhaps"})
    assert ff.validate_flag_updates({"fusedGemmAllReduce": "true"}) == {"fusedGemmAllReduce": True}


def test_session_phase_is_one_definition() -> None:
    hints = typing.get_type_hints(SessionStats)
    assert hints["phase"] is resources.SessionPhase
    crd_status = crdgen.session_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert crd_status["properties"]["phase"]["enum"] == [p.value for p in resources.SessionPhase]
    stats = SessionStats.model_validate_json('{"session_id": "ns/s", "phase": "Streaming"}')
    assert stats.phase is resources.SessionPhase.STREAMING
    assert '"phase":"Streaming"' in stats.model_dump_json()
