"""What a compiled graph's HLO says beyond its analyses: the weight-sized buffers a step
allocates beside the weights it reads, and the bytes it moves in HBM.

XLA picks a layout for every operand; when an op reads a weight in another layout than the one
it is stored in (a lookup gathering columns of a table stored by rows, say), the compiled graph
copies the whole weight at every step: its bytes read and written once more, and its size held
as scratch HBM the KV cache could have had. libtpu places small copies in VMEM, so the graph's
temp figure does not show them at tiny shapes; the scheduled HLO does, at any size.

libtpu's ``bytes accessed`` counts every buffer access in every memory space. Its memory-space
assignment prefetches weights from HBM into VMEM ahead of the matmul that reads them (a
``copy-start``/``copy-done`` pair, or a weight cut into ``slice`` s that a ``ConcatBitcast``
joins) and evicts the other way; the figure counts each such move four times (three for the
sliced form) on top of the consumer's read of the moved buffer, which stands for the one HBM
access the move is. ``hbm_bytes`` takes those counts away (``tests/.../test_hlo_audit.py``
checks the rule against graphs whose traffic is known).
"""
from __future__ import annotations

import math
import re
from typing import Dict, Iterable, List, Tuple

import torch

# numpy's dtype names -> HLO's element types
_HLO_TYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "int8": "s8", "uint8": "u8", "int32": "s32",
              "int4": "s4", "uint4": "u4", "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2", "bool": "pred"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\](?:\{([^}]*)\})?")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
# Opcodes that allocate nothing: views of buffers that exist already.
_NO_BUFFER = frozenset({"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "after-all"})
# How many times libtpu's cost analysis counts the bytes of one move between memory spaces
# beyond the read of the moved buffer: a copy pair (its operand, its output tuple's two
# buffers, the done's output) and a sliced prefetch (the slices in and out, the join).
_COUNTS_PER_COPY, _COUNTS_PER_SLICED_COPY = 4, 3

Shape = Tuple[str, Tuple[int, ...]]


def weight_shapes_per_chip(model: torch.nn.Module, min_bytes: int = 1 << 16) -> Dict[Shape, str]:
    """{(HLO element type, one chip's dims): a parameter's name} for the JAX path's placed
    ``model`` (each ``Tensor.jax()`` a shape with a sharding), parameters of ``min_bytes`` or more
    (a norm's weight has the shape of one token's activations)."""
    shapes = {}
    for name, tensor in model.named_parameters():
        array = tensor.jax()
        dims = tuple(array.sharding.shard_shape(tuple(array.shape)))
        if len(dims) >= 2 and array.dtype.itemsize * math.prod(dims) >= min_bytes:
            shapes.setdefault((_HLO_TYPES.get(array.dtype.name, array.dtype.name), dims), name)
    return shapes


def weight_sized_buffers(hlo_text: str, weights: Dict[Shape, str]) -> List[str]:
    """The buffers a compiled graph (``compiled.as_text()``) makes, outside fusions, by moving a
    weight-shaped parameter's elements (``_moves_elements``) into a buffer of that weight's
    element type and dims (or those dims reversed), either in HBM or in another layout than the
    row-major one it is stored in, each as
    ``"<instruction> <type>[dims] (<weight name>)"``. A weight prefetched into VMEM as it is
    stored is the compiler doing its job, not a copy; an activation that happens to have a
    weight's shape is not made from it."""
    found, computation, weight_params = [], "", set()
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and " = " not in line:
            computation = header.group(1)
            continue
        instruction = _INSTRUCTION.match(line)
        if instruction is None or "fus" in computation:
            continue
        name, shape_text, opcode = instruction.groups()
        matches = [(e, d, m, sp) for e, d, m, sp in _arrays(shape_text) if _weight_of(weights, e, d)]
        if opcode == "parameter" and matches:
            weight_params.add(name)
        reads_weight = _reads_any(line[instruction.end():], weight_params)
        if _allocates_nothing(opcode) and reads_weight:  # a view of the weight, or its prefetch into VMEM
            weight_params.add(name)
        if not reads_weight or not _moves_elements(opcode, line):
            continue
        for element, dims, minor_to_major, memory_space in matches:
            row_major = minor_to_major in ("", ",".join(str(d) for d in reversed(range(len(dims)))))
            if memory_space == 0 or not row_major:
                found.append(f"{name} {element}[{','.join(map(str, dims))}] ({_weight_of(weights, element, dims)})")
    return found


def _weight_of(weights: Dict[Shape, str], element: str, dims: Tuple[int, ...]):
    return weights.get((element, dims)) or weights.get((element, dims[::-1]))


def _moves_elements(opcode: str, line: str) -> bool:
    """A copy, a transpose or a loop fusion (XLA's form of a layout change or an elementwise
    pass); a matmul's fusion also reads the weight but makes activations, whatever their shape."""
    return opcode in ("copy", "transpose", "convert") or (opcode == "fusion" and "kind=kLoop" in line)


def _reads_any(operands: str, names) -> bool:
    return any(f"%{name})" in operands or f"%{name}," in operands for name in names)


def _allocates_nothing(opcode: str) -> bool:
    # Asynchronous pairs' shapes repeat their operands (views); what they bring in arrives as
    # the next instruction's buffer.
    return opcode in _NO_BUFFER or opcode.endswith(("-start", "-done"))


def _arrays(shape_text: str) -> Iterable[Tuple[str, Tuple[int, ...], str, int]]:
    """(element type, dims, minor-to-major, memory space) of every array in an HLO shape."""
    for element, dims, layout in _ARRAY.findall(shape_text):
        space = re.search(r"S\((\d+)\)", layout)
        yield (element, tuple(int(d) for d in dims.split(",") if d), layout.split(":")[0],
               int(space.group(1)) if space else 0)


def hbm_bytes(bytes_accessed: float, hlo_text: str) -> float:
    """A compiled graph's bytes read and written in HBM: libtpu's ``bytes accessed`` less what
    it counts for the moves between HBM and VMEM beyond the one access each stands for (module
    docstring). An upper bound still: a buffer made and read inside VMEM counts as accessed."""
    copied, sliced = memory_space_moves(hlo_text)
    return bytes_accessed - _COUNTS_PER_COPY * copied - _COUNTS_PER_SLICED_COPY * sliced


def memory_space_moves(hlo_text: str) -> Tuple[int, int]:
    """Bytes a compiled graph (``compiled.as_text()``) moves between memory spaces: by
    ``copy-start`` (prefetches and evictions), and by ``slice-start`` into another memory space
    than HBM (a sliced prefetch's pieces)."""
    copied = sliced = 0
    for line in hlo_text.splitlines():
        instruction = _INSTRUCTION.match(line)
        if instruction is None:
            continue
        _, shape_text, opcode = instruction.groups()
        arrays = list(_arrays(shape_text))
        if opcode == "copy-start" and arrays:  # (destination, source, context)
            copied += _array_bytes(arrays[0])
        elif opcode == "slice-start" and len(arrays) > 1 and arrays[1][3] != 0:  # ((operand), piece, context)
            sliced += _array_bytes(arrays[1])
    return copied, sliced


def _array_bytes(array: Tuple[str, Tuple[int, ...], str, int]) -> int:
    element, dims = array[0], array[1]
    width = re.match(r"[a-z]+(\d+)", element)  # bf16, s4, f8e4m3fn; pred is a byte
    return math.prod(dims) * (int(width.group(1)) if width else 8) // 8
