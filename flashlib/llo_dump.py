"""Read what libtpu dumps about a compiled kernel: its static cycle estimate and its VLIW bundle listing.

Both are text files libtpu writes while it compiles, when asked through ``LIBTPU_INIT_ARGS``
(:mod:`flashlib.estimate` does the asking). This module only parses them; it needs neither jax nor libtpu.

* ``--xla_jf_dump_static_llo_profile_to=DIR`` writes ``DIR/<op>_<device kind>_static_llo_profile.textproto``
  per compiled op (Pallas kernels, and XLA ops such as a ``pad``), a protobuf text message like::

      hlo_op_estimate {
        hlo_op_name: "flash_attention.1"
        estimated_cycles: 178098
        ...
      }

* ``--xla_jf_dump_to=DIR --xla_jf_dump_llo_text=true`` writes, among many passes,
  ``DIR/<id>-<op>-<NN>-final_bundles.txt``: the final program, one VLIW *bundle* (the instructions the
  TensorCore issues in one cycle) per line, e.g. ``0x141 : > { %4635 = vmatpush.bf16.msrb.mxu1 %v7489 ;;
  %1384 = vmatmul.bf16.vlgmr.msra.gmra.mxu2 %v7410 }``. :func:`bundle_stats` counts its instructions by
  kind. The counts are *static*: a loop body appears once however many times it runs.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BundleStats",
    "bundle_stats",
    "parse_textproto",
    "profile_cycles",
    "read_bundle_dir",
    "read_profile_dir",
]

PROFILE_SUFFIX = "_static_llo_profile.textproto"
_BUNDLE_FILE = re.compile(r"^\d+-(?P<op>.+)-\d+-final_bundles\.txt$")

# ---------------------------------------------------------------------------------------------------
# Protobuf text format
# ---------------------------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<comment>\#[^\n]*)
      | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
      | (?P<punct>[{}:<>\[\],;])
      | (?P<word>[^\s{}:<>\[\],;"'\#]+)
    )""",
    re.VERBOSE,
)


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            if text[pos:].strip():
                raise ValueError(f"cannot parse textproto near {text[pos:pos + 40]!r}")
            break
        pos = match.end()
        if match.lastgroup != "comment":
            out.append(match.group(match.lastgroup))
    return out


def _scalar(token: str) -> Any:
    if token[0] in "\"'":
        return bytes(token[1:-1], "utf-8").decode("unicode_escape")
    for kind in (int, float):
        try:
            return kind(token)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(token, token)  # an enum stays a string


def parse_textproto(text: str) -> dict[str, list[Any]]:
    """Parse protobuf text format into ``{field: [values]}`` (every field a list: any may repeat).

    A nested message becomes such a dict; numbers become int or float, ``true``/``false`` bool, strings
    are unquoted, enum names stay strings. No schema needed, so unknown fields are kept, not rejected.
    """
    tokens = _tokens(text)
    pos = 0

    def message(closing: str | None) -> dict[str, list[Any]]:
        nonlocal pos
        fields: dict[str, list[Any]] = {}
        while pos < len(tokens):
            name = tokens[pos]
            if name == closing:
                pos += 1
                return fields
            if name in ",;":
                pos += 1
                continue
            pos += 1
            if pos < len(tokens) and tokens[pos] == ":":
                pos += 1
            if pos >= len(tokens):
                raise ValueError(f"textproto ends after field {name!r}")
            if tokens[pos] in ("{", "<"):
                pos += 1
                value: Any = message("}" if tokens[pos - 1] == "{" else ">")
            else:
                value = _scalar(tokens[pos])
                pos += 1
            fields.setdefault(name, []).append(value)
        if closing is not None:
            raise ValueError(f"textproto message not closed with {closing!r}")
        return fields

    return message(None)


def _messages_with(tree: Mapping[str, list[Any]], *keys: str):
    """Every (nested) message of ``tree`` that has all ``keys``, outermost first."""
    if all(key in tree for key in keys):
        yield tree
    for values in tree.values():
        for value in values:
            if isinstance(value, dict):
                yield from _messages_with(value, *keys)


def profile_cycles(text: str) -> dict[str, int]:
    """``{op name: estimated_cycles}`` from one static-profile textproto (an op seen twice is summed)."""
    cycles: dict[str, int] = {}
    for msg in _messages_with(parse_textproto(text), "hlo_op_name", "estimated_cycles"):
        name = str(msg["hlo_op_name"][0])
        cycles[name] = cycles.get(name, 0) + int(msg["estimated_cycles"][0])
    return cycles


def read_profile_dir(directory: str | Path) -> dict[str, int]:
    """``{op name: estimated_cycles}`` over every ``*_static_llo_profile.textproto`` in ``directory``."""
    cycles: dict[str, int] = {}
    for path in sorted(Path(directory).glob(f"*{PROFILE_SUFFIX}")):
        for name, value in profile_cycles(path.read_text()).items():
            cycles[name] = cycles.get(name, 0) + value
    return cycles


# ---------------------------------------------------------------------------------------------------
# VLIW bundle listings
# ---------------------------------------------------------------------------------------------------

_BUNDLE_LINE = re.compile(r"^\s*(?:0x[0-9a-f]+|\d+)\s+[A-Z]*\s*:\s*>?\s*\{")  # "  0x10 LB: > { ... }"
_COMMENT = re.compile(r"/\*.*?\*/")
_OPCODE = re.compile(r"=\s+([a-z][a-z0-9_.]*)")  # "%1046 = vmatmul.bf16.vlgmr.msra.gmra.mxu0 %v7410_v38"
_MXU = re.compile(r"\bmxu\d+\b|(?<=\.)mxu\d+")

# Instruction kinds, by opcode prefix: the units a flash-attention step keeps busy.
_KINDS: dict[str, tuple[str, ...]] = {
    "vmatmul": ("vmatmul",),  # stream LHS rows through an MXU
    "vmatpush": ("vmatpush",),  # load weights (the RHS tile) into an MXU
    "mxu_pop": ("vpop.f32.mrf", "vpop.f32.mrb", "vpop.mrf", "vpop.mrb"),  # read results out of an MXU
    "xlu": ("vperm", "vrot", "vxpose"),  # cross-lane unit: permutes, rotations, transposes (and *.xlane ops)
    "eup": ("vexp", "vpow2", "vlog", "vrcp", "vrsqrt", "vtanh", "vpop.eup"),  # transcendental unit
    "vld": ("vld",),  # VMEM -> vector registers
    "vst": ("vst",),  # vector registers -> VMEM
    "dma": ("dma",),  # HBM <-> VMEM copies issued (not the ``dma.done.wait`` that waits for one)
}


@dataclass(frozen=True)
class BundleStats:
    """Static instruction counts of one kernel's final bundle listing.

    Attributes:
      op: the compiled op (kernel) name.
      bundles: VLIW bundles in the program (one issue slot row each; loops counted once).
      vmatmul, vmatpush, mxu_pop, xlu, eup, vld, vst, dma: instructions of each kind (see ``_KINDS``);
        ``xlu`` also counts reductions across lanes (``*.xlane.*``).
      mxus: the MXU units the program addresses, e.g. ``("mxu0", "mxu1", "mxu2", "mxu3")``.
      opcodes: every opcode and its count.
    """

    op: str
    bundles: int
    vmatmul: int
    vmatpush: int
    mxu_pop: int
    xlu: int
    eup: int
    vld: int
    vst: int
    dma: int
    mxus: tuple[str, ...]
    opcodes: Mapping[str, int] = field(repr=False)

    def __str__(self) -> str:
        kinds = ", ".join(f"{kind} {getattr(self, kind)}" for kind in _KINDS)
        return f"{self.op}: {self.bundles} bundles; {kinds}; MXUs {'/'.join(self.mxus) or '-'}"


def bundle_stats(text: str, op: str = "") -> BundleStats:
    """Count the instructions of one ``*final_bundles.txt`` listing by kind."""
    opcodes: Counter[str] = Counter()
    bundles = 0
    for line in text.splitlines():
        if not _BUNDLE_LINE.match(line):
            continue
        bundles += 1
        opcodes.update(_OPCODE.findall(_COMMENT.sub("", line)))
    counts = {kind: 0 for kind in _KINDS}
    for opcode, n in opcodes.items():
        if opcode.startswith("dma.done"):  # waiting for a copy, not issuing one
            continue
        for kind, prefixes in _KINDS.items():
            if opcode.startswith(prefixes) or (kind == "xlu" and ".xlane" in opcode):
                counts[kind] += n
                break
    mxus = sorted({m for opcode in opcodes for m in _MXU.findall(opcode)}, key=lambda m: int(m[3:]))
    return BundleStats(op=op, bundles=bundles, **counts, mxus=tuple(mxus), opcodes=dict(opcodes))


def read_bundle_dir(directory: str | Path, ops: set[str] | None = None) -> dict[str, BundleStats]:
    """:class:`BundleStats` of every op with a ``*-final_bundles.txt`` in ``directory`` (only ``ops`` if
    given; libtpu's own helper programs, ``<late-finalization>`` and ``TLP``, are skipped)."""
    stats: dict[str, BundleStats] = {}
    for path in sorted(Path(directory).iterdir()):
        match = _BUNDLE_FILE.match(path.name)
        if match is None or "schedule-analysis" in path.name:
            continue
        op = match.group("op")
        if op.startswith("<") or op == "TLP" or (ops is not None and op not in ops):
            continue
        stats[op] = bundle_stats(path.read_text(errors="replace"), op)
    return stats
