"""Spec strings <-> compressors for every registered compressor."""

from __future__ import annotations

import json
import zlib

import pytest

import gradwire
from gradwire import Compressor
from gradwire.compress.base import Param, _fmt
from gradwire.compress.registry import from_config, register
from gradwire.compress.sparse.base import _Sparse

NAMES = gradwire.available()

DESIGN_CODEC_IDS = {"none": 1, "fp16": 2, "bf16": 3, "fp8": 4, "int8": 5, "topk": 6, "randomk": 7, "threshold": 8,
                    "dgc": 9, "qsgd": 10, "terngrad": 11, "sign": 12, "onebit": 13, "zstd": 14, "fp4": 15}


def _cls(name: str) -> type[Compressor]:
    return type(gradwire.compressor(name))


def _candidates(p: Param) -> list:
    """Plausible non-default values of a parameter, most conservative first."""
    d = p.default
    if p.type is bool:
        return [not d] if d is not None else [True, False]
    if p.type is int:
        base = d if isinstance(d, int) else 8
        return [v for v in (base + 1, base - 1, base * 2, base // 2, 1, 2, 3, 4, 8, 16, 64, 256, 1024, 4096) if v != d]
    if p.type is float:
        base = d if isinstance(d, float) and d else 0.1
        return [v for v in (base / 2, base * 2, base / 10, 0.5, 0.25, 0.1, 0.01, 0.001, 1.0, 2.0, 10.0) if v != d]
    return []


def _valid_non_default(name: str, p: Param):
    for v in _candidates(p):
        try:
            c = gradwire.compressor(f"{name}:{p.name}={_fmt(v)}")
        except ValueError:
            continue
        return v, c
    return None, None


@pytest.mark.parametrize("name", NAMES)
def test_default_spec_round_trip(name):
    c = gradwire.compressor(name)
    assert str(c) == name, "defaults are left out of the canonical spec"
    assert c.name == name and gradwire.compressor(str(c)) == c
    assert c.crc == zlib.crc32(name.encode())
    config = c.get_config()
    assert config == {"name": name, **{p.name: p.default for p in c.params}}
    assert json.loads(json.dumps(config)) == config, "configs must be JSON-able"
    assert from_config(json.loads(json.dumps(config))) == c
    assert gradwire.from_config(config) == c and type(c).from_config(config) == c
    assert gradwire.compressor(config) == c and gradwire.compressor(c) is c
    assert repr(c) == f"gradwire.compressor({name!r})"
    if name in DESIGN_CODEC_IDS:
        assert c.codec_id == DESIGN_CODEC_IDS[name]
    assert c.role in ("dense", "sparse", "lossless")


def test_codec_ids_are_unique_and_in_a_byte():
    ids = [_cls(n).codec_id for n in NAMES]
    assert len(set(ids)) == len(ids) and all(1 <= i <= 255 for i in ids)


@pytest.mark.parametrize("name", NAMES)
def test_each_non_default_param_round_trips(name):
    cls = _cls(name)
    for p in cls.params:
        assert p.coerce(name, p.default) == p.default, f"{name}.{p.name}: the default fails its own check"
        if p.type is str:
            continue  # no generic candidates; such params are covered by their module's tests
        value, c = _valid_non_default(name, p)
        assert c is not None, f"{name}.{p.name}: none of {_candidates(p)} is accepted"
        assert getattr(c, p.name) == value
        spec = str(c)
        assert spec == f"{name}:{p.name}={_fmt(value)}"
        again = gradwire.compressor(spec)
        assert again == c and str(again) == spec and again.crc == c.crc != gradwire.compressor(name).crc
        config = json.loads(json.dumps(c.get_config()))
        assert from_config(config) == c
        if p.type is float:  # exponent notation parses to the same value
            assert gradwire.compressor(f"{name}:{p.name}={value:e}") == c
            assert gradwire.compressor(f"{name}:{p.name}={value:E}") == c
        if p.type is int:
            assert from_config({"name": name, p.name: float(value)}) == c  # 8.0 is the int 8


@pytest.mark.parametrize("name", NAMES)
def test_all_params_changed_at_once(name):
    cls = _cls(name)
    chosen = {}
    for p in cls.params:
        value, _ = _valid_non_default(name, p)
        if value is not None:
            chosen[p.name] = value
    try:
        c = cls(**chosen)
    except ValueError:  # a cross-parameter rule: keep the changes that go together
        kept: dict = {}
        for key, value in chosen.items():
            if _accepts(name, **kept, **{key: value}):
                kept[key] = value
        chosen = kept
        c = cls(**chosen)
    spec = str(c)
    assert spec.count("=") == len(chosen)
    assert gradwire.compressor(spec) == c and from_config(c.get_config()) == c
    reordered = name + ":" + ",".join(reversed(spec.partition(":")[2].split(","))) if chosen else name
    assert gradwire.compressor(reordered) == c, "parameter order in a spec does not matter"


@pytest.mark.parametrize("name", NAMES)
def test_bad_values_raise_naming_the_param(name):
    cls = _cls(name)
    for p in cls.params:
        if p.type in (int, float):
            with pytest.raises(ValueError, match=f"{name}: {p.name}=.*not a valid {p.type.__name__}"):
                gradwire.compressor(f"{name}:{p.name}=abc")
            if p.type is int:
                with pytest.raises(ValueError, match=p.name):
                    gradwire.compressor(f"{name}:{p.name}=2.5")
            if p.type is float:
                for bad in ("nan", "inf", "-inf"):
                    with pytest.raises(ValueError, match=f"{p.name}.*finite"):
                        gradwire.compressor(f"{name}:{p.name}={bad}")
        if p.check is not None and p.type in (int, float):
            rejected = []
            for v in (-1, 0, 10 ** 12, -(10 ** 12)):
                try:
                    cls(**{p.name: v})
                except ValueError as e:
                    assert p.name in str(e)
                    rejected.append(v)
                    if p.rule:
                        assert p.rule in str(e), f"the error should state the rule {p.rule!r}: {e}"
            assert rejected, f"{name}.{p.name} has a check but accepts -1, 0 and +-1e12"
        if p.type is bool:
            with pytest.raises(ValueError, match=p.name):
                gradwire.compressor(f"{name}:{p.name}=maybe")


@pytest.mark.parametrize("name", NAMES)
def test_unknown_param_lists_the_valid_ones(name):
    cls = _cls(name)
    with pytest.raises(ValueError, match="unknown parameter") as e:
        gradwire.compressor(f"{name}:bogus=1")
    message = str(e.value)
    assert "bogus" in message
    for p in cls.params:
        assert p.name in message
    if not cls.params:
        assert "none" in message


def test_unknown_name_lists_every_compressor():
    for spec in ("topkk", "fp16+zstdd", "ZSTD", "none+fp17"):
        with pytest.raises(ValueError, match="unknown compressor") as e:
            gradwire.compressor(spec)
        for name in NAMES:
            assert name in str(e.value)


@pytest.mark.parametrize("spec", ["", "   ", None, 3, ["fp16"]])
def test_empty_or_non_string_spec(spec):
    with pytest.raises(ValueError, match="non-empty string"):
        gradwire.compressor(spec)


def test_malformed_parameters():
    for spec, message in [("zstd:level", "expected key=value"), ("zstd:level=", "expected key=value"),
                          ("zstd:=3", "expected key=value"), ("zstd:level=3,", "expected key=value"),
                          ("zstd:level=3,level=4", "given twice")]:
        with pytest.raises(ValueError, match=message):
            gradwire.compressor(spec)
    assert gradwire.compressor("zstd:") == gradwire.compressor("zstd")


def test_whitespace_is_ignored():
    assert str(gradwire.compressor("  zstd : level = 5 ")) == "zstd:level=5"
    assert str(gradwire.compressor(" fp16 + zstd:level=4 ")) == "fp16+zstd:level=4"


def test_exponent_floats_parse():
    # (every float param in e/E notation: test_each_non_default_param_round_trips)
    c = gradwire.compressor("topk:ratio=1e-3")
    assert c.ratio == 0.001 and str(c) == "topk:ratio=0.001"
    assert gradwire.compressor("topk:ratio=1E-3") == c == gradwire.compressor("topk:ratio=0.001")
    assert gradwire.compressor("topk:ratio=5e-2+fp16") == gradwire.compressor("topk:ratio=0.05+fp16")
    assert gradwire.compressor("topk:ratio=2.5e-02+zstd").stages[0].ratio == 0.025
    assert gradwire.compressor("topk:ratio=1e+0+fp16").stages[0].ratio == 1.0 if _accepts("topk", ratio=1.0) \
        else gradwire.compressor("topk:ratio=1e-1+fp16").stages[0].ratio == 0.1


def _accepts(name: str, **kw) -> bool:
    try:
        _cls(name)(**kw)
        return True
    except ValueError:
        return False


def test_config_errors():
    for bad in ({}, {"level": 3}, "zstd", None, {"name": "nope"}):
        with pytest.raises(ValueError):
            from_config(bad)
    with pytest.raises(ValueError, match="unknown parameter"):
        from_config({"name": "zstd", "lvl": 3})


def test_from_config_builds_the_class_it_is_called_on():
    """`TopK.from_config` builds a TopK and refuses another compressor's config, naming both;
    on `Compressor` itself (or an abstract base) it builds whichever compressor the config names."""
    chain = gradwire.compressor("topk:ratio=0.05+qsgd:bits=4+zstd")
    for c in [gradwire.compressor(n) for n in NAMES] + [chain]:
        config = c.get_config()
        assert Compressor.from_config(config) == c and type(Compressor.from_config(config)) is type(c)
        assert type(c).from_config(config) == c
    topk, dgc = gradwire.compressor("topk:ratio=0.1"), gradwire.compressor("dgc")
    with pytest.raises(ValueError, match="TopK.from_config: the config names 'dgc', not 'topk'"):
        type(topk).from_config(dgc.get_config())
    with pytest.raises(ValueError, match="Chain.from_config: the config names 'topk', not 'chain'"):
        type(chain).from_config(topk.get_config())
    assert _Sparse.from_config(topk.get_config()) == topk  # an abstract base: no name of its own
    with pytest.raises(ValueError, match="'qsgd' is not a _Sparse"):
        _Sparse.from_config({"name": "qsgd"})
    with pytest.raises(ValueError, match="unknown compressor 'nope'"):
        Compressor.from_config({"name": "nope"})


def test_register_refuses_duplicates():
    zstd = _cls("zstd")

    class Again(Compressor):
        name = "zstd"
        codec_id = 250

    with pytest.raises(ValueError, match="registered twice"):
        register(Again)

    class SameId(Compressor):
        name = "zstd-copy"
        codec_id = zstd.codec_id

    with pytest.raises(ValueError, match="codec id 14 .* is taken by 'zstd'"):
        register(SameId)
    assert register(zstd) is zstd  # registering the same class again is a no-op
    assert "zstd-copy" not in gradwire.available()
