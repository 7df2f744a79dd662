"""What a pre-quantized Hugging Face folder's `quantization_config` says, read as vLLM reads it: the
method from `quant_method` (`gptq`, `awq`, `compressed-tensors`), and every variant pagedrl cannot hold
refused in one line that names the field, its value and what is supported.

Supported (weight-only integers; the packed tensors are read by `model/prequantized.py`):
- gptq: 4 or 8 bits, any group size (-1: one group a row), `desc_act` (act-order `g_idx`), `sym` either
  way; `checkpoint_format` "gptq" (zero points stored minus one, as GPTQ's CUDA kernels add it back) or
  "gptq_v2" (stored as they are); `lm_head` true (the head packed too, on an untied head only); GPTQModel's
  `dynamic`: per-module rules, read as vLLM's `get_dynamic_override` reads them (the first key whose regex
  `re.match`es the module's name wins; "-:" leaves the module float, "+:" or no prefix overrides `bits`,
  `group_size`, `sym`, `desc_act`; other keys are calibration settings, unread).
- awq: 4 bits, `version` "gemm" (AutoAWQ's GEMM layout), `zero_point` true.
- compressed-tensors: `format` "pack-quantized" or "naive-quantized", integer weights of 4 or 8 bits,
  strategy "group" or "channel", symmetric or not, no activation quantization, no group act-order
  (`actorder` "group": compressed-tensors itself has dropped it; "weight" reorders at calibration only).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

PREQUANTIZED = ("gptq", "awq", "compressed-tensors")  # the `quantization` names a folder's config.json gives
SUPPORTED = ("supported: gptq (4 or 8 bits, checkpoint_format gptq or gptq_v2), awq (4 bits, version gemm, "
             "zero_point true), compressed-tensors (format pack-quantized or naive-quantized; int weights of 4 or "
             "8 bits, strategy group or channel, actorder none or weight, no input_activations)")
CT_FORMATS = ("pack-quantized", "naive-quantized")


class PrequantizedError(ValueError):
    """A quantization_config pagedrl cannot hold: the field, its value and what is supported."""


@dataclass(frozen=True)
class Scheme:
    """What the packed tensors hold: `method`, its `bits`, and the layout's variant (`variant`: gptq's
    checkpoint_format, awq's version, compressed-tensors' format)."""

    method: str
    bits: int
    variant: str
    group_size: int | None = None  # gptq's (-1: a row); None: read from the scales' shape
    sym: bool | None = None  # gptq's (true: every zero point 2^(bits-1)); None: the stored zero points
    desc_act: bool | None = None  # gptq's (false: groups in input order); None: the stored g_idx
    dynamic: tuple[tuple[str, dict[str, Any]], ...] = ()  # gptq's per-module rules, in the config's order
    rule: str | None = None  # the `dynamic` key this module's settings came from
    lm_head: bool = False  # gptq's `lm_head`: the head packed too

    def where(self, field: str) -> str:
        """Where this module's `field` was set (a `dynamic` rule, or the config), for an error to name."""
        if self.rule is not None and field in dict(self.dynamic)[self.rule]:
            return f"quantization_config.dynamic[{self.rule!r}].{field}"
        return f"quantization_config.{field}"

    def for_module(self, name: str) -> Scheme | None:
        """This module's settings under `dynamic` (None: a "-:" rule leaves it unquantized), as vLLM's
        `get_dynamic_override`: the first key whose regex matches the start of the name."""
        for key, overrides in self.dynamic:
            if key.startswith("-:"):
                if re.match(key[2:], name):
                    return None
            elif re.match(key.removeprefix("+:"), name):
                fields = {f: overrides[f] for f in ("bits", "group_size", "sym", "desc_act") if f in overrides}
                return replace(self, rule=key, **fields)
        return self


def quant_method(folder: Path) -> str | None:
    """config.json's `quantization_config.quant_method` (None: none, or a folder without config.json)."""
    config = folder / "config.json"
    if not folder.is_dir() or not config.is_file():
        return None
    try:
        raw = json.loads(config.read_text())
    except json.JSONDecodeError:
        return None  # (reading the folder's config reports it)
    quant = raw.get("quantization_config") if isinstance(raw, dict) else None
    if quant is None:
        return None
    return str(quant.get("quant_method")) if isinstance(quant, dict) else repr(quant)


def check_float_load(folder: Path) -> None:
    """Refuse, in one line, a folder whose weights are quantized by a method a float load cannot read
    (gpt-oss's MXFP4 experts dequantize at load, `model/mxfp4.py`): the three read here are served kept
    quantized, the rest are not supported."""
    method = quant_method(folder)
    if method is None or method == "mxfp4":
        return
    if method in PREQUANTIZED:
        raise PrequantizedError(f"{folder}: quantization_config.quant_method {method!r}: pre-quantized weights, served "
                                f"kept quantized (LLM, pagedrl generate / serve); a float load (training, merging) "
                                "needs the float checkpoint")
    raise _refuse(str(folder / "config.json"), "quant_method", method)


def _refuse(source: str, field: str, value: Any) -> PrequantizedError:
    return PrequantizedError(f"{source}: quantization_config.{field} = {json.dumps(value)} is not supported; {SUPPORTED}")


def read_scheme(folder: Path) -> Scheme:
    """The folder's quantization_config checked field by field (`PrequantizedError` for the first that
    pagedrl cannot hold)."""
    source = str(folder / "config.json")
    quant = json.loads((folder / "config.json").read_text()).get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") not in PREQUANTIZED:
        raise _refuse(source, "quant_method", quant.get("quant_method") if isinstance(quant, dict) else quant)
    method = quant["quant_method"]
    if method == "gptq":
        bits = quant.get("bits")
        if bits not in (4, 8):
            raise _refuse(source, "bits", bits)
        variant = quant.get("checkpoint_format") or "gptq"
        if variant not in ("gptq", "gptq_v2"):
            raise _refuse(source, "checkpoint_format", variant)
        settings = {f: quant.get(f) for f in ("group_size", "sym", "desc_act")}
        _check_settings(source, "", settings)
        if quant.get("lm_head", False) not in (True, False):
            raise _refuse(source, "lm_head", quant.get("lm_head"))
        return Scheme(method, bits, variant, **settings, dynamic=_dynamic(source, quant.get("dynamic")),
                      lm_head=quant.get("lm_head", False))
    if method == "awq":
        if quant.get("bits", 4) != 4:
            raise _refuse(source, "bits", quant.get("bits"))
        variant = str(quant.get("version", "gemm")).lower()
        if variant != "gemm":
            raise _refuse(source, "version", quant.get("version"))
        if quant.get("zero_point", True) is not True:
            raise _refuse(source, "zero_point", quant.get("zero_point"))
        return Scheme(method, 4, variant)
    return _compressed_tensors(quant, source)


def _check_settings(source: str, where: str, settings: dict[str, Any]) -> None:
    """gptq's per-module fields (the config's, or a `dynamic` rule's at `where`) of the types they must have."""
    for field, ok in (("bits", lambda v: v in (4, 8)), ("group_size", lambda v: type(v) is int and (v == -1 or v > 0)),
                      ("sym", lambda v: type(v) is bool), ("desc_act", lambda v: type(v) is bool)):
        if settings.get(field) is not None and not ok(settings[field]):
            raise _refuse(source, f"{where}{field}", settings[field])


def _dynamic(source: str, dynamic: Any) -> tuple[tuple[str, dict[str, Any]], ...]:
    """GPTQModel's `dynamic` rules checked: each key a regex ("-:" / "+:" / no prefix), each "+" rule a
    dict whose bits, group_size, sym and desc_act pagedrl can hold."""
    if dynamic is None:
        return ()
    if not isinstance(dynamic, dict):
        raise _refuse(source, "dynamic", dynamic)
    for key, overrides in dynamic.items():
        try:
            re.compile(key.removeprefix("-:").removeprefix("+:"))
        except re.error as e:
            raise PrequantizedError(f"{source}: quantization_config.dynamic key {key!r} is not a regular expression "
                                    f"({e})") from None
        if not isinstance(overrides, dict):
            raise _refuse(source, f"dynamic[{key!r}]", overrides)
        if not key.startswith("-:"):
            _check_settings(source, f"dynamic[{key!r}].", overrides)
    return tuple(dynamic.items())


def _compressed_tensors(quant: dict[str, Any], source: str) -> Scheme:
    """compressed-tensors: every config group's weights checked; the bits are each tensor's own (a
    folder may mix 4 and 8), so the scheme's `bits` is the largest."""
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse(source, "config_groups", groups)
    bits = 0
    variant = quant.get("format")
    for name, group in groups.items():
        field = f"config_groups.{name}"
        fmt = group.get("format") or variant
        if fmt not in CT_FORMATS:
            raise _refuse(source, f"{field}.format" if group.get("format") else "format", fmt)
        variant = variant or fmt
        for activations in ("input_activations", "output_activations"):
            if group.get(activations) is not None:
                raise _refuse(source, f"{field}.{activations}", group[activations])
        weights = group.get("weights")
        if not isinstance(weights, dict):
            raise _refuse(source, f"{field}.weights", weights)
        for key, allowed in (("type", ("int",)), ("num_bits", (4, 8)), ("strategy", ("group", "channel")),
                             ("dynamic", (False, None)), ("actorder", (None, "weight", "static"))):
            if weights.get(key) not in allowed:
                raise _refuse(source, f"{field}.weights.{key}", weights.get(key))
        bits = max(bits, weights["num_bits"])
    return Scheme("compressed-tensors", bits, str(variant))
