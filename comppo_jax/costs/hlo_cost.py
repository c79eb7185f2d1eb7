"""What a compiled program costs per chip, read from its optimized HLO (the chips' peaks:
comppo_jax.costs.chips).

`compiled.cost_analysis()` counts a `while` body once, and every program here loops: the decoder
layers run under `lax.scan`, the vocabulary projection in chunks, decoding in a `while_loop`. So
`program_cost` walks `compiled.as_text()` itself, multiplying each loop body by its trip count:

- FLOPs: every `dot`, `convolution` and cuBLAS gemm call (also inside fusions), 2 x output
  elements x contracted size, split by operand width (16 bits or less vs float32, which some chips run slower); the
  attention kernels XLA cannot see into (splash, the concentration kernel, ragged paged
  attention) from their operand shapes (`_attention_flops`). Elementwise work is not counted.
- HBM bytes: operands + outputs of every top-level instruction (a fusion reads its inputs and
  writes its outputs once), as XLA's own analysis does; a ragged paged attention call reads the
  pages a row of mean context length spans, not the whole pool.
- Collective bytes each chip sends: all-gather output x (n-1)/n, reduce-scatter output x (n-1),
  all-reduce 2 x size x (n-1)/n (a ring), all-to-all size x (n-1)/n, collective-permute size.
- Collective latency: the hops of a ring over the group, all-reduce 2 (n-1), collective-permute
  1, the others n-1, each paying the chip's `hop_latency` (what decoding pays per layer in a
  tensor-parallel group, where the messages are small).

A loop's trip count is read from its condition (`i < constant`, as `scan` and `fori_loop` with
static bounds compile); a loop whose bound is data-dependent (decoding until every row ends)
takes its count from `loop_trips`, keyed by the `jax.named_scope` around it. A loop that has
neither is counted once and listed in `ProgramCost.unknown_loops`. A `cond` counts its costlier
branch, or, named in `branch_rates`, that branch at the given rate and the other otherwise
(decoding admits new rows on a few of its steps).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import NamedTuple

from comppo_jax.costs.chips import Chip


class ProgramCost(NamedTuple):
    """One program's per-chip cost (loop trip counts applied)."""

    flops_16bit: float  # dots with operands of 16 bits or less, and the attention kernels
    flops_fp32: float  # float32 dots
    hbm_bytes: float
    collective_bytes: float
    collectives: dict  # kind -> bytes
    unknown_loops: tuple = ()  # op names of loops counted once
    unknown_kernels: tuple = ()  # custom calls with no FLOP model (their bytes are counted)
    collective_hops: float = (
        0.0  # ring steps of every collective (module docstring), each paying the chip's hop_latency
    )

    @property
    def flops(self) -> float:
        return self.flops_16bit + self.flops_fp32

    def __add__(self, other: ProgramCost) -> ProgramCost:
        kinds = {
            k: self.collectives.get(k, 0.0) + other.collectives.get(k, 0.0)
            for k in {*self.collectives, *other.collectives}
        }
        return ProgramCost(
            self.flops_16bit + other.flops_16bit,
            self.flops_fp32 + other.flops_fp32,
            self.hbm_bytes + other.hbm_bytes,
            self.collective_bytes + other.collective_bytes,
            kinds,
            tuple(sorted({*self.unknown_loops, *other.unknown_loops})),
            tuple(sorted({*self.unknown_kernels, *other.unknown_kernels})),
            self.collective_hops + other.collective_hops,
        )

    def scaled(self, factor: float) -> ProgramCost:
        return ProgramCost(
            self.flops_16bit * factor,
            self.flops_fp32 * factor,
            self.hbm_bytes * factor,
            self.collective_bytes * factor,
            {k: v * factor for k, v in self.collectives.items()},
            self.unknown_loops,
            self.unknown_kernels,
            self.collective_hops * factor,
        )


ZERO = ProgramCost(0.0, 0.0, 0.0, 0.0, {})


def compute_seconds(cost: ProgramCost, chip: Chip) -> float:
    return cost.flops_16bit / chip.bf16_flops + cost.flops_fp32 / chip.fp32_flops


def bound(cost: ProgramCost, chip: Chip) -> str:
    """ "compute" or "memory": which side of the roofline the program sits on."""
    return "compute" if compute_seconds(cost, chip) >= cost.hbm_bytes / chip.hbm_bytes else "memory"


def roofline_seconds(cost: ProgramCost, chip: Chip) -> float:
    """max(FLOPs / peak FLOP/s, HBM bytes / HBM bandwidth) + collective bytes / ICI bandwidth
    + collective hops x hop latency."""
    return (
        max(compute_seconds(cost, chip), cost.hbm_bytes / chip.hbm_bytes)
        + cost.collective_bytes / chip.ici_bytes
        + cost.collective_hops * chip.hop_latency
    )


# ---------------------------------------------------------------------------------------------
# Reading the HLO text.

_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "s4": 0.5,
    "u4": 0.5,
}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(")
_FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "while",
    "call",
    "conditional",
    "after-all",
    "partition-id",
    "replica-id",
    "iota",
    "copy-done",
    "all-gather-done",
    "all-reduce-done",
    "collective-permute-done",
    "send-done",
    "recv-done",
    "async-done",
    "slice-done",
    "opt-barrier",
    "custom-call-done",
}
_SLICES = ("dynamic-slice", "slice", "gather")
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass
class _Instruction:
    name: str
    type: str
    opcode: str
    operands: list
    arguments: str  # the text between the opcode's parentheses (a constant's value)
    attributes: str
    is_root: bool


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(type_text)
        if dtype in _BYTES
    ]


def _bytes(type_text: str) -> float:
    return sum(_BYTES[dtype] * math.prod(dims) for dtype, dims in _arrays(type_text))


def _closing(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f"unbalanced brackets in HLO line: {text[:200]}")


def _parse_instruction(line: str) -> _Instruction | None:
    body = line.strip()
    is_root = body.startswith("ROOT ")
    if is_root:
        body = body[5:]
    if not body.startswith("%") or " = " not in body:
        return None
    name, rest = body[1:].split(" = ", 1)
    end = _closing(rest, 0) if rest.startswith("(") else rest.index(" ")
    type_text, rest = rest[:end], rest[end:].lstrip()
    paren = rest.index("(")
    opcode = rest[:paren]
    close = _closing(rest, paren)
    operands = re.findall(r"%([\w.\-]+)", rest[paren:close])
    return _Instruction(name, type_text, opcode, operands, rest[paren + 1 : close - 1], rest[close:], is_root)


def parse_hlo(text: str) -> tuple[dict[str, list[_Instruction]], str]:
    """{computation name: instructions} and the entry computation's name."""
    computations, entry, current = {}, None, None
    for line in text.splitlines():
        if not line.startswith(" ") and line.endswith("{"):
            header = _HEADER.match(line)
            if header:
                current = computations.setdefault(header.group(1), [])
                if line.startswith("ENTRY"):
                    entry = header.group(1)
                continue
        if line == "}":
            current = None
        elif current is not None:
            instruction = _parse_instruction(line)
            if instruction:
                current.append(instruction)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def _called(attributes: str, key: str) -> list[str]:
    """The computations an attribute names: `calls=%f` or `branch_computations={%a, %b}`."""
    found = re.search(key + r"=(\{[^}]*\}|%?[\w.\-]+)", attributes)
    return re.findall(r"%?([\w.\-]+)", found.group(1)) if found else []


def _group_size(attributes: str, devices: int) -> int:
    """Devices per replica group: `{{0,1},{2,3}}`, the iota form `[groups,size]<=[...]` or the mesh
    form `mesh['axis_0'=4,'axis_1'=2] {'axis_1'}` (the product of the named axes)."""
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=", attributes)
    if iota:
        return int(iota.group(1).split(",")[-1])
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes)
    if mesh:
        sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
        return math.prod(sizes[name] for name in re.findall(r"'([^']+)'", mesh.group(2)))
    explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", attributes)
    if explicit and explicit.group(1):
        return len(explicit.group(1).split(","))
    return devices


def _dot_flops(instruction: _Instruction, shapes: dict) -> float:
    output = sum(math.prod(dims) for _, dims in _arrays(instruction.type))
    lhs = shapes.get(instruction.operands[0])
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.attributes)
    if lhs is None or contracting is None:
        return 0.0
    size = math.prod(lhs[1][int(d)] for d in contracting.group(1).split(",") if d)
    return 2.0 * output * size


def _conv_flops(instruction: _Instruction, shapes: dict) -> float:
    """2 x batch x output features x input features per group x the valid window positions summed
    over every output position (XLA's count; a dot often compiles to a convolution on TPU)."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instruction.attributes)
    lhs, rhs = shapes.get(instruction.operands[0]), shapes.get(instruction.operands[1])
    if labels is None or lhs is None or rhs is None:
        return 0.0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    out_dims = _arrays(instruction.type)[0][1]
    window = re.search(r"window=\{([^}]*)\}", instruction.attributes)
    fields = dict(re.findall(r"(\w+)=([\w\-x]+)", window.group(1))) if window else {}
    spatial = [c for c in lhs_labels if c.isdigit()]
    stride = [int(x) for x in fields["stride"].split("x")] if "stride" in fields else [1] * len(spatial)
    pads = (
        [tuple(int(p) for p in x.split("_")) for x in fields["pad"].split("x")]
        if "pad" in fields
        else [(0, 0)] * len(spatial)
    )
    dilation = [int(x) for x in fields["rhs_dilate"].split("x")] if "rhs_dilate" in fields else [1] * len(spatial)
    positions = 1
    for axis, label in enumerate(spatial):
        in_size = lhs[1][lhs_labels.index(label)]
        out_size = out_dims[out_labels.index(label)]
        window_size = rhs[1][rhs_labels.index(label)]
        low = pads[axis][0]
        positions *= sum(
            sum(1 for k in range(window_size) if 0 <= o * stride[axis] + k * dilation[axis] - low < in_size)
            for o in range(out_size)
        )
    batch = out_dims[out_labels.index("b")]
    return 2.0 * batch * out_dims[out_labels.index("f")] * rhs[1][rhs_labels.index("i")] * positions


def _gemm_flops(instruction: _Instruction, shapes: dict) -> float:
    """A cuBLAS gemm custom call (XLA:GPU's dots): its contracting dims are in its backend config."""
    lhs = shapes.get(instruction.operands[0]) if instruction.operands else None
    contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instruction.attributes)
    if lhs is None or contracting is None:
        return 0.0
    size = math.prod(lhs[1][int(d)] for d in re.findall(r"\d+", contracting.group(1)))
    return 2.0 * math.prod(_arrays(instruction.type)[0][1]) * size


def _matmul_cost(instruction: _Instruction, shapes: dict) -> ProgramCost:
    flops = {"dot": _dot_flops, "convolution": _conv_flops, "custom-call": _gemm_flops}[instruction.opcode](
        instruction, shapes
    )
    wide = any(shapes.get(o, ("",))[0] in ("f32", "f64") for o in instruction.operands[:2])
    return ProgramCost(0.0, flops, 0.0, 0.0, {}) if wide else ProgramCost(flops, 0.0, 0.0, 0.0, {})


def _collective_size(instruction: _Instruction, types: dict) -> float:
    """A collective's result bytes; an async `-start` returns (operands, results), so its operands are taken off."""
    size = _bytes(instruction.type)
    if instruction.opcode.endswith("-start"):
        size = max(size - sum(_bytes(types.get(o, "")) for o in instruction.operands), size / 2)
    return size


def _collective_cost(instruction: _Instruction, types: dict, devices: int) -> ProgramCost:
    """Bytes one chip sends (module docstring)."""
    kind = instruction.opcode.removesuffix("-start")
    n = _group_size(instruction.attributes, devices)
    size = _collective_size(instruction, types)
    sent = {
        "all-gather": size * (n - 1) / n,
        "reduce-scatter": size * (n - 1),
        "all-reduce": 2 * size * (n - 1) / n,
        "all-to-all": size * (n - 1) / n,
        "collective-permute": size,
    }[kind]
    return ProgramCost(0.0, 0.0, 0.0, sent, {kind: sent}, collective_hops=float(ring_steps(kind, n)))


def ring_steps(kind: str, group: int) -> int:
    """Steps of a ring collective over `group` devices, each paying a hop's latency: all-reduce
    2 (n-1) (reduce-scatter, then all-gather), collective-permute 1, the others n-1."""
    if group <= 1:
        return 0
    return {"all-reduce": 2 * (group - 1), "collective-permute": 1}.get(kind, group - 1)


def _live_rows(instruction: _Instruction, rows: int | None) -> int:
    """Query rows of a decode attention call that attend: its output's first dim, at most `rows`
    (the engine pads a shard's rows to a TPU tile; the padding reads one position)."""
    out = _arrays(instruction.type)[0][1][0]
    return out if rows is None else min(out, rows)


# Attention kernels whose blocks skip the keys of other segments on packed rows (their cost: the
# `visited` share of the causal blocks; `program_cost(attention_visited=...)`).
SEGMENT_SKIPPING = ("attention_with_concentration", "packed_flash_attention")


def _attention_flops(
    instruction: _Instruction, shapes: dict, context: float | None, rows: int | None = None, visited: float = 1.0
) -> float | None:
    """FLOPs of the attention kernels XLA treats as opaque custom calls, from their shapes. Causal
    self-attention over L keys is 2 matmuls x 2 x heads x L^2 / 2 x d forward (QK^T and PV), the
    queries [..., heads, L, d] being the kernel's largest operand; splash's backward kernels take
    3 (dq) and 4 (dkv) such matmuls; decode attends `context` keys per token [tokens, heads, d]."""
    name = instruction.name
    if name.startswith(("splash_mha", "attention_with_concentration", "flash_attention", "packed_flash_attention")):
        operands = [shapes[o][1] for o in instruction.operands if o in shapes and len(shapes[o][1]) >= 3]
        if not operands:
            return None
        q = max(operands, key=math.prod)
        length, head_dim = q[-2], q[-1]
        matmuls = 3 if "_dq" in name else 4 if ("_dkv" in name or "_dkdv" in name) else 2
        # The kernels that skip other segments' key blocks visit this share of the causal blocks.
        share = visited if name.startswith(SEGMENT_SKIPPING) else 1.0
        return share * matmuls * 2.0 * math.prod(q[:-2]) * length * length * head_dim / 2
    if "paged_attention" in name and context is not None:
        return 2.0 * 2.0 * _live_rows(instruction, rows) * math.prod(_arrays(instruction.type)[0][1][1:]) * context
    return None


def _paged_kv_bytes(instruction: _Instruction, shapes: dict, context: float, rows: int | None = None) -> float:
    """Bytes a decode attention call reads: the keys and values of `context` positions per live row,
    with their scales where the pages are 8-bit. Its pools are either one combined array [pages,
    page, 2 Hkv, hd] (the ragged kernel) or heads-first keys and values [Hkv, pages, page, hd], with
    8-bit pages' scales per head [Hkv, pages, page] or per page [pages, Hkv * 2 * page]."""
    operands = [shapes[o] for o in instruction.operands if o in shapes]
    arrays = [dims for _, dims in operands if len(dims) == 4]
    if not arrays:
        return 0.0
    pool = max(arrays, key=math.prod)  # the largest (a query may be 4-d too)
    pools = [(dtype, dims) for dtype, dims in operands if dims == pool]
    combined = len(pools) == 1
    pages, page_size = pool[:2] if combined else pool[1:3]
    scales = [
        (dtype, dims)
        for dtype, dims in operands
        if not combined and (dims == pool[:-1] or (len(dims) == 2 and dims[0] == pages and dims[1] % page_size == 0))
    ]
    per_position = sum(math.prod(dims) * _BYTES[dtype] for dtype, dims in pools + scales) / (pages * page_size)
    return _live_rows(instruction, rows) * context * per_position


def _sliced_reads(computations: dict, computation: str, index: int) -> float | None:
    """The bytes a fused computation reads of its parameter `index` when every use of it takes a
    slice, directly, inside nested fusions (a scanned layer's weights sliced from the stacked
    [N, ...] array within the fusion of its matmul) or after a relayout of the whole operand (int8
    weights re-tiled for the MXU, then sliced); None when some use reads it whole."""
    fused = computations.get(computation, [])
    name = next((i.name for i in fused if i.opcode == "parameter" and i.arguments == str(index)), None)
    return None if name is None else _value_sliced_reads(computations, computation, name)


# Same elements in another layout or dtype: a fusion reads their operand as it reads them.
_RELAYOUTS = ("copy", "bitcast", "convert")


def _value_sliced_reads(computations: dict, computation: str, name: str) -> float | None:
    """`_sliced_reads` of the value `name` of `computation`."""
    fused = computations.get(computation, [])
    value = next((i for i in fused if i.name == name), None)
    users = [i for i in fused if name in i.operands]
    if value is None or not users:
        return None

    def through(user: _Instruction) -> float | None:
        """The reads of `value` through `user`, a relayout of all of it: as `user` is read."""
        if _arrays(user.type)[:1] and _arrays(user.type)[0][1] != _arrays(value.type)[0][1]:
            return None
        read = _value_sliced_reads(computations, computation, user.name)
        return None if read is None else read * _bytes(value.type) / max(_bytes(user.type), 1.0)

    total = 0.0
    for user in users:
        if user.opcode in _SLICES and user.operands[0] == name and name not in user.operands[1:]:
            total += _bytes(user.type)
            continue
        if user.opcode in _RELAYOUTS:
            read = through(user)
        elif user.opcode == "fusion":
            called = _called(user.attributes, "calls")[0]
            positions = [k for k, operand in enumerate(user.operands) if operand == name]
            reads = [_sliced_reads(computations, called, k) for k in positions]
            root = next((i for i in computations.get(called, []) if i.is_root), None)
            relayout = root is not None and root.opcode in _RELAYOUTS and len(positions) == 1 == len(user.operands)
            read = through(user) if None in reads and relayout else (None if None in reads else sum(reads))
        else:
            read = None
        if read is None:
            return None
        total += read
    return total


def _moved_bytes(instruction: _Instruction, types: dict, computations: dict) -> float:
    """HBM bytes an instruction reads and writes, as XLA's cost analysis counts them: an operand
    a fusion only slices (a scanned layer's weights from the stacked [N, ...] array) is read as
    its slices, and a dynamic-update-slice or scatter (alone or as a fusion's root) updates its
    buffer in place, moving the update, not the buffer."""
    output = _bytes(instruction.type)
    operands = [_bytes(types.get(o, "")) for o in instruction.operands]
    root = instruction.opcode
    if root == "dynamic-slice":
        return 2 * output + sum(operands[1:])
    if root == "fusion":
        fused = computations.get(_called(instruction.attributes, "calls")[0], [])
        top = next((i for i in fused if i.is_root), None)
        root = top.opcode if top is not None else root
        parameters = {i.name: int(i.arguments) for i in fused if i.opcode == "parameter" and i.arguments.isdigit()}
        users = {}
        for i in fused:
            for o in i.operands:
                if o in parameters:
                    users.setdefault(parameters[o], []).append(i)

        called = _called(instruction.attributes, "calls")[0]
        for index in range(len(operands)):
            read = _sliced_reads(computations, called, index)
            if read is not None:
                operands[index] = min(operands[index], read)
        # A tuple root that passes a parameter through (async collective fusions do) neither reads nor writes it.
        if root == "tuple":
            for name in top.operands:
                index = parameters.get(name)
                if index is not None and index < len(operands):
                    output -= operands[index]
                    if all(u is top for u in users.get(index, [])):
                        operands[index] = 0.0
    if root in ("dynamic-update-slice", "scatter") and output in operands:
        operands.remove(output)  # the buffer, updated in place
        return 2 * sum(operands)
    return output + sum(operands)


def _scope_value(instruction: _Instruction, values: dict):
    """values[scope] when the instruction is the `while`/`cond` directly under `jax.named_scope(scope)`."""
    op_name = re.search(r'op_name="([^"]*)"', instruction.attributes)
    for scope, value in values.items():
        if op_name and re.search(rf"(^|/){re.escape(scope)}/(while|cond)$", op_name.group(1)):
            return value
    return None


def program_cost(
    text: str,
    *,
    devices: int = 1,
    loop_trips: dict | None = None,
    branch_rates: dict | None = None,
    context: float | None = None,
    decode_rows: int | None = None,
    attention_visited: float = 1.0,
) -> ProgramCost:
    """The per-chip cost of a compiled program (see the module docstring). `text`:
    `compiled.as_text()`; `devices`: chips in the program, the group size of a collective that
    names none; `loop_trips`: {named scope: trip count} for loops with data-dependent bounds;
    `branch_rates`: {named scope: how often its `cond` takes the costlier branch} (else always);
    `context`: mean keys a decode attention call reads per row; `decode_rows`: rows per call that
    attend (beyond them, the engine's tile padding); `attention_visited`: the share of causal blocks
    the segment-skipping attention kernels visit (packed rows: `SEGMENT_SKIPPING`)."""
    computations, entry = parse_hlo(text)
    loop_trips, branch_rates = loop_trips or {}, branch_rates or {}
    memo: dict[str, ProgramCost] = {}

    def trip_count(instruction: _Instruction) -> int | None:
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', instruction.attributes)
        if known:
            return int(known.group(1))
        trips = _scope_value(instruction, loop_trips)
        if trips is not None:
            return trips
        condition = computations.get(_called(instruction.attributes, "condition")[0], [])
        constants = {
            i.name: int(i.arguments)
            for i in condition
            if i.opcode == "constant" and re.fullmatch(r"-?\d+", i.arguments) and _arrays(i.type)[0][1] == ()
        }
        # The induction variable is a tuple element of the loop state; a bound on anything computed
        # from the state (decoding's count of finished rows) is data-dependent.
        counters = {i.name for i in condition if i.opcode == "get-tuple-element"}
        for i in condition:
            if i.opcode == "compare" and len(i.operands) == 2:
                direction = re.search(r"direction=(\w+)", i.attributes).group(1)
                lhs, rhs = i.operands
                if direction == "LT" and lhs in counters and rhs in constants:
                    return constants[rhs]
                if direction == "GT" and rhs in counters and lhs in constants:
                    return constants[lhs]
        return None

    def work(i: _Instruction, shapes: dict, types: dict) -> ProgramCost:
        """An instruction's FLOPs and collectives; a fusion's are those inside it (its bytes are
        its own operands and outputs)."""
        if i.opcode in ("dot", "convolution") or (i.opcode == "custom-call" and "__cublas" in i.attributes):
            return _matmul_cost(i, shapes)
        if i.opcode == "fusion":
            instructions = computations.get(_called(i.attributes, "calls")[0], [])
            inner_shapes = {j.name: _arrays(j.type)[0] for j in instructions if _arrays(j.type)}
            inner_types = {j.name: j.type for j in instructions}
            return sum((work(j, inner_shapes, inner_types) for j in instructions), ZERO)
        if i.opcode.removesuffix("-start") in _COLLECTIVES:
            return _collective_cost(i, types, devices)
        return ZERO

    def walk(name: str) -> ProgramCost:
        if name in memo:
            return memo[name]
        total = ZERO
        unknown_loops, unknown_kernels = [], []
        instructions = computations.get(name, [])
        shapes = {i.name: _arrays(i.type)[0] for i in instructions if _arrays(i.type)}
        types = {i.name: i.type for i in instructions}
        for i in instructions:
            if i.opcode == "while":
                trips = trip_count(i)
                if trips is None:
                    trips = 1
                    op_name = re.search(r'op_name="([^"]*)"', i.attributes)
                    unknown_loops.append(op_name.group(1) if op_name else i.name)
                body = walk(_called(i.attributes, "body")[0]) + walk(_called(i.attributes, "condition")[0])
                total = total + body.scaled(trips)
                continue
            if i.opcode == "call":
                total = total + walk(_called(i.attributes, "to_apply")[0])
                continue
            if i.opcode == "conditional":
                branches = _called(i.attributes, "branch_computations") or (
                    _called(i.attributes, "true_computation") + _called(i.attributes, "false_computation")
                )
                ordered = sorted((walk(b) for b in branches), key=lambda c: (c.flops, c.hbm_bytes))
                rate = _scope_value(i, branch_rates)
                rate = 1.0 if rate is None else rate
                total = total + ordered[-1].scaled(rate) + ordered[0].scaled(1 - rate)
                continue
            if i.opcode in _FREE or i.opcode.endswith("-done"):
                continue
            if 'custom_call_target="AllocateBuffer"' in i.attributes:
                continue
            moved = _moved_bytes(i, types, computations)
            inner = work(i, shapes, types)
            if i.opcode == "custom-call" and (
                'custom_call_target="tpu_custom_call"' in i.attributes or "__gpu$xla.gpu.triton" in i.attributes
            ):
                flops = _attention_flops(i, shapes, context, decode_rows, attention_visited)
                if flops is None:
                    unknown_kernels.append(i.name.split(".")[0])
                else:
                    inner = ProgramCost(flops, 0.0, 0.0, 0.0, {})
                if "paged_attention" in i.name and context is not None:
                    moved = _bytes(i.type) + _paged_kv_bytes(i, shapes, context, decode_rows)
            total = total + inner + ProgramCost(0.0, 0.0, moved, 0.0, {})
        memo[name] = total._replace(
            unknown_loops=tuple(sorted({*total.unknown_loops, *unknown_loops})),
            unknown_kernels=tuple(sorted({*total.unknown_kernels, *unknown_kernels})),
        )
        return memo[name]

    return walk(entry)


class Collective(NamedTuple):
    kind: str  # all-gather, all-reduce, ...
    bytes: float  # its result's bytes (an async start's: the result without the operands it carries)
    group: int  # devices per replica group
    name: str


def loop_collectives(text: str, scope: str, devices: int = 1) -> list[Collective]:
    """The collectives one iteration of the `while` under `jax.named_scope(scope)` runs (its body,
    the computations it calls and their fusions), read from `compiled.as_text()`. What launch/plan.py
    and the tests assert about decoding: no weight is gathered inside its loop."""
    computations, entry = parse_hlo(text)
    loops = [
        i
        for instructions in computations.values()
        for i in instructions
        if i.opcode == "while" and _scope_value(i, {scope: True})
    ]
    if not loops:
        raise ValueError(f"no while loop under the named scope {scope!r} in the program")
    found, seen = [], set()

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        instructions = computations.get(name, [])
        types = {i.name: i.type for i in instructions}
        for i in instructions:
            for key in (
                "calls",
                "body",
                "condition",
                "to_apply",
                "branch_computations",
                "true_computation",
                "false_computation",
            ):
                for called in _called(i.attributes, key):
                    visit(called)
            kind = i.opcode.removesuffix("-start")
            if kind in _COLLECTIVES:
                found.append(Collective(kind, _collective_size(i, types), _group_size(i.attributes, devices), i.name))

    for loop in loops:
        visit(_called(loop.attributes, "body")[0])
    return found
