"""TPU layout facts every kernel here is written against, and the checks they share.

- A vreg is 8 sublanes x 128 lanes of 32-bit words; the last two dims of a block must be
  multiples of (8, 128) or span the whole array. bf16 packs two rows per sublane, so its
  row (second-minor) multiple is 16.
- VMEM: Mosaic's default scoped limit is 16 MiB on v4/v5e (32 MiB on v6e); blocks are
  double-buffered by the pipeline, so a kernel's estimate counts every block twice.
"""
from __future__ import annotations

LANES, SUBLANES = 128, 8
VMEM_BUDGET_BYTES = 16 * 1024 * 1024
DTYPES = ("float32", "bfloat16")


def sublanes(dtype_name: str) -> int:
    """Row multiple of a block: 8 for 32-bit types, 16 for bf16 (two rows per sublane)."""
    return 16 if dtype_name == "bfloat16" else SUBLANES


def gmm_row_tile(m: int, dtype_name: str) -> int:
    """The gmm kernels' row tile for ``m`` rows: up to 256, a multiple of ``sublanes``."""
    row = sublanes(dtype_name)
    return min(256, -(-m // row) * row)


def lowering_chip(device_kind: str, num_cores: int = 1):
    """A context in which Pallas lowers for ``device_kind`` (JAX's name, e.g. "TPU v6 lite"):
    its TPU lowering reads the chip from the mesh context, and a lowering on this CPU (no TPU
    devices, no libtpu) has none. A one-device abstract mesh of that chip names it."""
    import jax
    from jax._src.mesh import AbstractDevice  # no public constructor: jax 0.10's Pallas reads it

    chip = AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="tpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("tp",), abstract_device=chip))


def torch_dtype_name(tensor) -> str:
    """``"float32"`` for a torch float32 tensor: the names the checks here take."""
    return str(tensor.dtype).removeprefix("torch.")


def itemsize(dtype_name: str) -> int:
    return 2 if dtype_name == "bfloat16" else 4


def check_dtype(op: str, dtype_name: str) -> None:
    if dtype_name not in DTYPES:
        raise ValueError(f"{op} supports {DTYPES}, got {dtype_name}")


def check_vmem(op: str, need: int, what: str) -> None:
    if need > VMEM_BUDGET_BYTES:
        raise ValueError(f"{op}: {what} needs {need} bytes of VMEM, over the "
                         f"{VMEM_BUDGET_BYTES}-byte budget; use smaller blocks")


def check_attention_operands(op: str, q, k_pages, v_pages) -> None:
    """q [tokens, heads, head_dim] and equal 4-D K/V pages of q's dtype (torch or JAX arrays)."""
    if len(q.shape) != 3 or len(k_pages.shape) != 4 or tuple(k_pages.shape) != tuple(v_pages.shape):
        raise ValueError(f"{op} wants q [tokens, heads, head_dim] and equal 4-D K/V pages, got "
                         f"{list(q.shape)}, {list(k_pages.shape)}, {list(v_pages.shape)}")
    if not q.dtype == k_pages.dtype == v_pages.dtype:
        raise ValueError(f"{op}: q, k and v dtypes differ: {q.dtype}, {k_pages.dtype}, {v_pages.dtype}")


def check_attention_shapes(op: str, q_shape, pages_shape, dtype_name: str) -> None:
    """q [tokens, heads, head_dim] against pages [kv_heads, blocks, block_size, head_dim]."""
    check_dtype(op, dtype_name)
    _, heads, head_dim = q_shape
    kv_heads, _, _, page_dim = pages_shape
    if page_dim != head_dim or heads % kv_heads:
        raise ValueError(f"{op}: q {tuple(q_shape)} does not fit pages {tuple(pages_shape)}: "
                         f"head_dim must match and heads must be a multiple of kv_heads")
    if head_dim % LANES:
        raise ValueError(f"{op}: head_dim={head_dim} must be a multiple of {LANES} (TPU lanes)")
