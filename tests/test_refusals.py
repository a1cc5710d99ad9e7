"""Refuse or compute right, at every entry point (issue 24): ``attention``, ``decode_attention`` (every impl),
``sharded_attention`` and ``ring_attention`` share one validation (:mod:`flashlib.arguments`), so a bad argument is
a ``ValueError`` naming it at each door, and an input the contract accepts gets the float64 oracle's answer.

Fixed cases, one per repro of the issue, and one search: :func:`test_bad_inputs_are_refused_or_answered_right`
draws a bad (or borderline) argument and an entry point and asserts "a ValueError whose message names the
argument, or the oracle's answer" (``derandomize=False``: a random draw each run, the seed printed on failure).
Search or smoke (``tests/conftest.py``): the search runs in full in the main environment and as a random quarter
under ``make test-colab`` (the checks it reaches are plain Python and jnp on tiny shapes).

Sharded and ring attention run here on a one-device mesh (``jax.make_mesh((1,), ("x",))``: Explicit axes in the
newest jax, Auto in jax 0.7.2); what needs several devices to show — ``layout="bshd"`` splitting the right
axis, an eager gradient on the default mesh outside ``jax.set_mesh`` — is a case of ``tests/sharded_checks.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import search_examples
from hypothesis import given, settings
from hypothesis import strategies as st

import flashlib
from flashlib import decode
from flashlib.kernels import decode_attention
from flashlib.reference import attention_oracle, attention_vjp_oracle
from flashlib.ring import ring_attention
from flashlib.sharded import sharded_attention

F32 = jnp.float32
ATOL = 2e-5  # float32 against the float64 oracle at these tiny sizes (measured errors ~1e-7)


def _qkv(batch=1, heads=2, q_len=4, kv_len=4, d=8, kv_heads=None, seed=0):
    rng = np.random.default_rng(seed)
    kv_heads = heads if kv_heads is None else kv_heads
    return tuple(jnp.asarray(rng.normal(size=shape), F32) for shape in
                 ((batch, heads, q_len, d), (batch, kv_heads, kv_len, d), (batch, kv_heads, kv_len, d)))


def _mesh():
    return jax.make_mesh((1,), ("x",))


# ---------------------------------------------------------------------------------------------------
# attention: values that were taken for something else
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["reference", "blockwise", "xla", "pallas"])
@pytest.mark.parametrize(("argument", "value"), [("causal", "False"), ("causal", 1), ("causal", None),
                                                  ("scale", True), ("scale", "0.1"), ("scale", 0.0),
                                                  ("scale", float("nan")), ("scale", -1)])
def test_attention_refuses_a_causal_or_scale_of_the_wrong_kind(impl, argument, value):
    """``causal="False"`` was taken as True (a non-empty string), ``scale=True`` as 1.0."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=argument):
        flashlib.attention(q, k, v, impl=impl, **{argument: value})


@pytest.mark.parametrize("scale", [np.float32(0.125), np.float64(0.3), np.int64(1), 2])
def test_attention_takes_numpy_scalars_as_scale(scale):
    """``scale=np.float32(0.125)`` was refused as "not a positive finite number"."""
    q, k, v = _qkv()
    got = flashlib.attention(q, k, v, scale=scale, causal=np.bool_(True), impl="reference")
    np.testing.assert_allclose(got, attention_oracle(q, k, v, causal=True, scale=float(scale)), atol=ATOL)


@pytest.mark.parametrize("impl", ["reference", "blockwise", "xla", "pallas"])
def test_int64_segment_ids_beyond_int32_are_refused_not_wrapped(impl):
    """q ids 2**32 and kv ids 0: no query may see any key; cast to int32, 2**32 wrapped to 0 and every impl
    returned full attention."""
    q, k, v = _qkv()
    ids = (np.full((1, 4), 2**32, np.int64), np.zeros((1, 4), np.int64))
    with pytest.raises(ValueError, match=r"segment_ids' q_segments .*int32.*renumber"):
        flashlib.attention(q, k, v, segment_ids=ids, impl=impl)
    with pytest.raises(ValueError, match=r"segment_ids' kv_segments"):
        flashlib.attention(q, k, v, segment_ids=(ids[1], np.full((1, 4), -(2**31) - 1, np.int64)), impl=impl)
    if impl == "reference":  # int64 ids inside int32's range are fine (the check runs before any impl)
        small = (ids[0] - 2**32 + 7, ids[1] + 7)
        np.testing.assert_allclose(flashlib.attention(q, k, v, segment_ids=small, impl=impl),
                                   attention_oracle(q, k, v), atol=ATOL)


@pytest.mark.parametrize("impl", ["reference", "blockwise", "xla", "pallas"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_sinks_are_refused(impl, bad):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="sinks must be finite"):
        flashlib.attention(q, k, v, sinks=jnp.asarray([bad, 0.0]), impl=impl)


def test_a_minus_inf_sink_is_no_sink():
    q, k, v = _qkv()
    got = flashlib.attention(q, k, v, sinks=jnp.asarray([-jnp.inf, 0.5]), impl="reference")
    np.testing.assert_allclose(got, attention_oracle(q, k, v, sinks=np.asarray([-np.inf, 0.5])), atol=ATOL)


@pytest.mark.parametrize("impl", ["reference", "blockwise", "xla", "pallas"])
@pytest.mark.parametrize(("shapes", "axis"), [
    (((0, 2, 4, 8), (0, 2, 4, 8)), "batch"),
    (((1, 0, 4, 8), (1, 1, 4, 8)), "heads of q"),
    (((1, 2, 4, 8), (1, 0, 4, 8)), "heads of k"),
])
def test_an_empty_batch_or_head_axis_is_named(impl, shapes, axis):
    """Batch 0 or heads 0 was a ZeroDivisionError, an einsum error or a Pallas TypeError (xla returned empty)."""
    qs, ks = shapes
    with pytest.raises(ValueError, match=f"empty input: {axis}"):
        flashlib.attention(jnp.zeros(qs), jnp.zeros(ks), jnp.zeros(ks), impl=impl)


# ---------------------------------------------------------------------------------------------------
# decode_attention: the contract's "never seen", the shared checks, the options an impl does not read
# ---------------------------------------------------------------------------------------------------

DECODE_IMPLS = ["pallas", "split_kv", "reference"]


def _paged_cache(rng, lengths, *, num_pages=10, page_size=4, pages_per_seq=3, kv_heads=1, d=8):
    k, v = (jnp.asarray(rng.normal(size=(num_pages, kv_heads, page_size, d)), F32) for _ in range(2))
    table = jnp.asarray(rng.permutation(num_pages)[: len(lengths) * pages_per_seq].reshape(len(lengths), -1),
                        jnp.int32)
    return decode.PagedKVCache(k, v, table, jnp.asarray(lengths, jnp.int32))


def _decode(q, cache, impl, **options):
    return decode_attention(q, cache, impl=impl, interpret=True, **options)


def _jit_decode(q, cache, impl, **options):
    """One compiled program (op by op, the pure-JAX impls spend seconds dispatching); the cache's values traced."""
    return _compiled_decode(impl, tuple(sorted(options.items())))(q, cache)


@functools.cache
def _compiled_decode(impl, options):
    return jax.jit(functools.partial(_decode, impl=impl, **dict(options)))


@pytest.mark.parametrize("impl", ["split_kv", "reference"])  # the kernel's: tests/test_decode_kernel.py
def test_nan_past_the_length_is_never_seen(impl):
    """A contiguous cache's tail, a page still named in the block table but past the length, the tail of a
    partly filled page: NaN there (in k and v) reached split_kv's and the reference's output through ``0 * NaN``."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(2, 2, 2, 8)), F32)
    contiguous = decode.KVCache(*(jnp.asarray(rng.normal(size=(2, 1, 16, 8)), F32) for _ in range(2)),
                                jnp.asarray([5, 11], jnp.int32))
    paged = _paged_cache(rng, [6, 3])  # 6 keys: page 1 half full, page 2 unused; 3 keys: one page, partly
    want = [decode.decode_oracle(q, contiguous), decode.decode_oracle(q, paged)]
    tail = jnp.arange(16)[None, None, :, None] >= contiguous.lengths[:, None, None, None]
    contiguous = contiguous._replace(k=jnp.where(tail, jnp.nan, contiguous.k), v=jnp.where(tail, jnp.nan, contiguous.v))
    table = np.asarray(paged.block_table)

    def poison(pool):
        pool = pool.at[table[0, 1], :, 2:].set(jnp.nan).at[table[0, 2]].set(jnp.nan)  # past sequence 0's 6 keys
        return pool.at[table[1, 0], :, 3:].set(jnp.nan).at[table[1, 1:]].set(jnp.nan)  # past sequence 1's 3 keys

    paged = paged._replace(k_pages=poison(paged.k_pages), v_pages=poison(paged.v_pages))
    options = {"num_splits": 2} if impl == "split_kv" else {}
    for cache, exact in zip((contiguous, paged), want, strict=True):
        got = np.asarray(_jit_decode(q, cache, impl, **options), np.float64)
        np.testing.assert_allclose(got, exact, atol=ATOL, err_msg=type(cache).__name__)


@pytest.mark.parametrize("impl", DECODE_IMPLS)
@pytest.mark.parametrize(("argument", "value"), [("scale", 0), ("scale", -1.0), ("scale", float("nan")),
                                                  ("scale", True), ("interpret", "x"), ("interpret", 1)])
def test_decode_checks_scale_and_interpret_as_attention_does(impl, argument, value):
    rng = np.random.default_rng(2)
    cache = _paged_cache(rng, [5])
    with pytest.raises(ValueError, match=argument):
        decode_attention(jnp.zeros((1, 2, 1, 8)), cache, impl=impl, **{argument: value})


@pytest.mark.parametrize(("impl", "options", "named"), [
    ("reference", {"num_splits": 0}, "num_splits"), ("reference", {"num_splits": 2}, "num_splits"),
    ("reference", {"block_k": 0}, "block_k"), ("reference", {"block_k": 100}, "block_k"),
    ("reference", {"pages_per_step": 2}, "pages_per_step"),
    ("split_kv", {"block_k": 128}, "block_k"), ("split_kv", {"pages_per_step": 1}, "pages_per_step"),
    ("split_kv", {"num_splits": 0}, "num_splits"), ("pallas", {"num_splits": 0}, "num_splits"),
    ("pallas", {"pages_per_step": 0}, "pages_per_step"), ("pallas", {"block_k": 128}, "block_k"),
])
def test_decode_refuses_options_an_impl_does_not_read(impl, options, named):
    """``impl="reference"`` silently ignored ``num_splits=0``, ``block_k=0/100`` and ``pages_per_step``."""
    rng = np.random.default_rng(3)
    with pytest.raises(ValueError, match=named):
        decode_attention(jnp.zeros((1, 2, 1, 8)), _paged_cache(rng, [5]), impl=impl, interpret=True, **options)


@pytest.mark.parametrize("impl", DECODE_IMPLS)
def test_decode_names_an_empty_query(impl):
    """q_len 0 was a ZeroDivisionError in the Pallas path."""
    rng = np.random.default_rng(4)
    with pytest.raises(ValueError, match="q_len is 0"):
        decode_attention(jnp.zeros((1, 2, 0, 8)), _paged_cache(rng, [5]), impl=impl, interpret=True)


def test_the_decode_kernel_says_it_has_no_gradient():
    """Under ``jax.grad`` Pallas raised ``NotImplementedError('')``."""
    rng = np.random.default_rng(5)
    cache = _paged_cache(rng, [5])
    q = jnp.asarray(rng.normal(size=(1, 2, 1, 8)), F32)
    with pytest.raises(NotImplementedError, match="no gradient.*flashlib.attention"):
        jax.grad(lambda q: decode_attention(q, cache, interpret=True).sum())(q)
    with pytest.raises(NotImplementedError, match="no gradient"):
        jax.grad(lambda k: decode_attention(q, cache._replace(k_pages=k), interpret=True).sum())(cache.k_pages)


def test_a_traced_page_id_outside_the_pool_reads_the_same_page_on_every_impl():
    """Under ``jit`` a page id of -3 was clamped to page 0 by the kernel but wrapped to page 9 by split-KV and the
    reference (their outputs differed by 0.53); now every impl reads the nearest page, as the kernel does."""
    rng = np.random.default_rng(6)
    cache = _paged_cache(rng, [7, 12])
    q = jnp.asarray(rng.normal(size=(2, 2, 1, 8)), F32)
    for bad, nearest, impls in ((-3, 0, DECODE_IMPLS), (99, 9, ["split_kv", "reference"])):
        table = cache.block_table.at[0, 1].set(bad)
        want = decode.decode_oracle(q, cache._replace(block_table=table.at[0, 1].set(nearest)))
        for impl in impls:  # the kernel one page per grid step (its cheapest interpreted program)
            options = {"pages_per_step": 1} if impl == "pallas" else {}
            got = _jit_decode(q, cache._replace(block_table=table), impl, **options)
            np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=ATOL, err_msg=f"{impl} {bad}")
        with pytest.raises(ValueError, match=r"block_table\[0\] names pages"):  # concrete: refused, every impl
            _decode(q, cache._replace(block_table=table), "reference")


# ---------------------------------------------------------------------------------------------------
# sharded_attention and ring_attention on a one-device mesh (the default of jax.make_mesh: Explicit axes in the
# newest jax, Auto in jax 0.7.2)
# ---------------------------------------------------------------------------------------------------


def test_sharded_attention_takes_segment_ids_on_the_default_mesh():
    """On Explicit axes ``place`` mapped one PartitionSpec over the pair of segment-id specs: AttributeError."""
    q, k, v = _qkv(batch=1, q_len=6, kv_len=6)
    ids = (jnp.asarray([[0, 0, 1, 1, 1, 2]]), jnp.asarray([[0, 0, 1, 1, 1, 2]]))
    mesh = _mesh()

    def loss(q):
        out = sharded_attention(q, k, v, mesh=mesh, batch_axis="x", segment_ids=ids, sinks=jnp.zeros(2),
                                impl="reference")
        return jnp.sum(out * out), out

    (_, out), dq = jax.jit(jax.value_and_grad(loss, has_aux=True))(q)  # one program: eager shard_map is slow
    variants = {"segment_ids": ids, "sinks": np.zeros(2)}
    exact = attention_oracle(q, k, v, **variants)
    np.testing.assert_allclose(out, exact, atol=ATOL)
    np.testing.assert_allclose(dq, attention_vjp_oracle(q, k, v, 2 * exact, **variants)[0], atol=ATOL)


@pytest.mark.parametrize("entry", ["sharded", "ring"])
def test_sharded_and_ring_take_the_bshd_layout(entry):
    """``layout="bshd"`` went through ``**options`` to each device's attention while the specs assumed bhsd (on
    several devices ``head_axis`` split the sequence: tests/sharded_checks.py's bshd case); the ring refused it
    as an unknown worker option. Now both handle the layout themselves."""
    q, k, v = _qkv(batch=1, heads=2, q_len=6, kv_len=6, kv_heads=1)
    bshd = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]
    mesh = _mesh()
    if entry == "sharded":
        run = functools.partial(sharded_attention, mesh=mesh, head_axis="x", causal=True, layout="bshd",
                                impl="reference")
    else:
        run = functools.partial(ring_attention, mesh=mesh, seq_axis="x", causal=True, layout="bshd", impl="reference")
    out = jax.jit(run)(*bshd)
    np.testing.assert_allclose(out.transpose(0, 2, 1, 3), attention_oracle(q, k, v, causal=True), atol=ATOL)
    with pytest.raises(ValueError, match="layout='hsbd'"):
        (sharded_attention if entry == "sharded" else ring_attention)(
            q, k, v, mesh=mesh, layout="hsbd", **({"head_axis": "x"} if entry == "sharded" else {"seq_axis": "x"}))


@pytest.mark.parametrize("option", ["block_q", "block_k"])
@pytest.mark.parametrize("value", [0, -8, 2.5, True])
def test_ring_names_a_bad_block_size(option, value):
    """``block_q=0`` was a ZeroDivisionError in tiling.py."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=f"{option} must be a positive int"):
        ring_attention(q, k, v, mesh=_mesh(), seq_axis="x", impl="blockwise", **{option: value})


@pytest.mark.parametrize("entry", ["sharded", "ring"])
@pytest.mark.parametrize(("argument", "value"), [("causal", "False"), ("scale", True), ("scale", 0.0)])
def test_sharded_and_ring_check_the_shared_arguments(entry, argument, value):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=argument):
        if entry == "sharded":
            sharded_attention(q, k, v, mesh=_mesh(), head_axis="x", impl="reference", **{argument: value})
        else:
            ring_attention(q, k, v, mesh=_mesh(), seq_axis="x", impl="reference", **{argument: value})


def test_sharded_checks_concrete_ids_and_sinks_before_shard_map():
    """Inside ``shard_map`` the ids and sinks are traced, so their values are checked before it."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="int32"):
        sharded_attention(q, k, v, mesh=_mesh(), batch_axis="x", impl="reference",
                          segment_ids=(np.full((1, 4), 2**32, np.int64), np.zeros((1, 4), np.int64)))
    with pytest.raises(ValueError, match="sinks must be finite"):
        sharded_attention(q, k, v, mesh=_mesh(), head_axis="x", impl="reference", sinks=jnp.asarray([0.0, np.nan]))


@pytest.mark.parametrize("entry", ["sharded", "ring"])
def test_gradients_inside_and_outside_a_mesh_context_agree(entry):
    """The Auto twin (outside ``jax.set_mesh``) and the mesh as given (inside it) give attention's gradient. On one
    device the eager gradient on Explicit axes worked before too: the failure needed several devices
    (tests/sharded_checks.py's eager case). Compiled: eager shard_map and scan take a minute here."""
    q, k, v = _qkv()
    mesh = _mesh()

    def loss(q):
        if entry == "sharded":
            return jnp.sum(sharded_attention(q, k, v, mesh=mesh, batch_axis="x", impl="reference") ** 2)
        return jnp.sum(ring_attention(q, k, v, mesh=mesh, seq_axis="x", impl="reference") ** 2)

    want = attention_vjp_oracle(q, k, v, 2 * attention_oracle(q, k, v))[0]  # d/dq sum(out^2): do = 2 out
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(q), want, atol=ATOL)
    if entry == "sharded":  # the ring's program is the same inside a mesh context: once is enough here
        with jax.set_mesh(mesh):
            np.testing.assert_allclose(jax.jit(jax.grad(loss))(q), want, atol=ATOL)


# ---------------------------------------------------------------------------------------------------
# What flashlib.masks says about NaN in a key or value a row cannot see
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["reference", "blockwise", "xla", "pallas"])
def test_nan_in_an_unseen_key_never_reaches_a_row_and_in_an_unseen_value_does(impl):
    """The claim of :mod:`flashlib.masks`, on one score tile (8 tokens, causal: only the last row sees key 7)."""
    q, k, v = _qkv(q_len=8, kv_len=8)
    options = {"interpret": True} if impl == "pallas" else {}
    run = jax.jit(functools.partial(flashlib.attention, causal=True, impl=impl, **options))
    got = np.asarray(run(q, k.at[:, :, 7].set(jnp.nan), v))
    np.testing.assert_allclose(got[:, :, :7], attention_oracle(q, k, v, causal=True)[:, :, :7], atol=ATOL)
    assert np.isnan(got[:, :, 7]).all()  # the row that sees the NaN key
    got = np.asarray(run(q, k, v.at[:, :, 7].set(jnp.nan)))
    assert np.isnan(got).any(axis=-1).all(), "0 * NaN: every row of the tile, though only the last sees the value"


# ---------------------------------------------------------------------------------------------------
# The search: a bad (or borderline) argument at one of the four doors
# ---------------------------------------------------------------------------------------------------

ENTRY_POINTS = ("attention", "decode", "sharded", "ring")
IDS_OK = np.asarray([[0, 0, 1, 1]], np.int32)
VALUES = {  # argument: values to try, good and bad (the oracle decides what a good one must give)
    "scale": [None, 0.5, np.float32(0.25), np.int64(1), 0, -1.0, float("nan"), float("inf"), True, "0.5",
              np.bool_(True), jnp.asarray(0.5)],
    "causal": [False, True, np.bool_(True), "False", 0, 1, None, "yes"],
    "window": [(2, 0), (None, 1), (0, None), (-1, 0), 3, (1.5, 0), (True, 0), (1, 2, 3)],
    "softcap": [30.0, np.float32(5.0), 0, -1.0, float("nan"), True, "30"],
    "segment_ids": [(IDS_OK, IDS_OK), (IDS_OK.astype(np.int64) + 2**31 - 2, IDS_OK.astype(np.int64) + 2**31 - 2),
                    (IDS_OK.astype(np.int64) + 2**31, IDS_OK), (IDS_OK, IDS_OK.astype(np.uint32) + 2**31),
                    (IDS_OK.astype(np.float32), IDS_OK), (IDS_OK[:, :3], IDS_OK), IDS_OK,
                    (IDS_OK.astype(bool), IDS_OK)],
    "sinks": [np.zeros(2, np.float32), np.asarray([-np.inf, 1.0], np.float32), np.asarray([np.nan, 0.0], np.float32),
              np.asarray([np.inf, 0.0], np.float32), np.zeros(2, np.int32), np.zeros(3, np.float32)],
    "interpret": [True, False, None, "x", 1, np.bool_(True)],
    "layout": ["bhsd", "bshd", "BSHD", None, "bhds"],
}
TAKES = {  # the arguments each door takes (any other is refused by name, or is not a keyword at all)
    "attention": ("scale", "causal", "window", "softcap", "segment_ids", "sinks", "layout"),
    "decode": ("scale", "softcap", "window", "interpret"),
    "sharded": ("scale", "causal", "window", "softcap", "segment_ids", "sinks", "layout"),
    "ring": ("scale", "causal", "layout", "window", "segment_ids", "sinks"),  # variants: refused as worker options
}


def _call(entry, argument, value):
    """``(got, want)``: the door's output and the float64 oracle's answer, or a ValueError from the door. Every
    call runs as one compiled program whose inputs are constants (concrete: their values are checked)."""
    q, k, v = _qkv(q_len=4, kv_len=4)
    given = {argument: value}
    if entry == "decode":
        cache = decode.KVCache(k, v, jnp.asarray([3], jnp.int32))
        q1 = q[:, :, :1]
        got = jax.jit(lambda: decode_attention(q1, cache, impl="reference", **given))()
        options = {n: given[n] for n in ("scale", "softcap", "window") if n in given}
        return got, decode.decode_oracle(q1, cache, **options)
    layout = given.pop("layout", "bhsd")
    arrays = [x.transpose(0, 2, 1, 3) for x in (q, k, v)] if layout == "bshd" else [q, k, v]
    if argument == "layout":
        given["layout"] = layout
    mesh = _mesh()
    door = {"attention": functools.partial(flashlib.attention, impl="reference"),
            "sharded": functools.partial(sharded_attention, mesh=mesh, batch_axis="x", head_axis=None,
                                         impl="reference"),
            "ring": functools.partial(ring_attention, mesh=mesh, seq_axis="x", impl="reference")}[entry]
    got = jax.jit(lambda: door(*arrays, **given))()
    if layout == "bshd":
        got = got.transpose(0, 2, 1, 3)
    exact = {n: x for n, x in given.items() if n != "layout"}
    if "causal" in exact:
        exact["causal"] = bool(exact["causal"])
    return got, attention_oracle(q, k, v, **exact)


@settings(max_examples=search_examples(25))
@given(entry=st.sampled_from(ENTRY_POINTS), data=st.data())
def test_bad_inputs_are_refused_or_answered_right(entry, data):
    """Every door, every shared argument: a ValueError naming the argument, or the oracle's answer."""
    argument = data.draw(st.sampled_from(sorted(set(TAKES[entry]) | {"scale"})), label="argument")
    value = data.draw(st.sampled_from(VALUES[argument]), label="value")
    try:
        got, want = _call(entry, argument, value)
    except ValueError as error:
        assert argument in str(error), f"{entry}({argument}={value!r}) refused without naming it: {error}"
        return
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=ATOL,
                               err_msg=f"{entry}({argument}={value!r}) accepted: it must give the oracle's answer")
