"""The native CPU backend beyond the shared test body: build on/off, dispatch, bad calls.

The shared body (`test_attention_backends.py`, backend `native_cpu`) checks values,
gradients, masked rows, NaN poisoning and determinism when the extension is built.
Here: without the extension (or switched off at build time) the backend says why and
dispatch falls back to `xla`; with it, it is CPU's default (`implementation=None`, as
`("native_cpu", "xla")`), operands XLA partitions outside shard_map go to `xla` (inside
shard_map the kernels run per device), the large unmasked tiles match the reference, and
a malformed call to the custom call itself is an error, never a crash.
"""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.kernels import registry
from shardfuse.kernels.attention import native_cpu


def _inputs(dtype=jnp.float32, T=40, S=56, H=4, K=2, D=32):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, T, H, D)).astype(dtype)
    k = jax.random.normal(keys[1], (2, S, K, D)).astype(dtype)
    v = jax.random.normal(keys[2], (2, S, K, D)).astype(dtype)
    return q, k, v


def test_native_cpu_is_registered_and_cpu_s_default():
    attention = registry.get("attention")
    assert "native_cpu" in attention.names
    assert attention.preference["cpu"] == ("native_cpu", "xla")
    # the ring's per-step kernels follow the attention op's preference
    assert registry.get("ring_attention").candidates(None)[0] == "native_cpu"


def test_without_the_extension_status_says_why_and_dispatch_falls_back(monkeypatch):
    def absent():
        raise NotImplementedError(native_cpu._why_not_built())

    monkeypatch.setattr(native_cpu, "_extension", absent)
    ok, why = registry.get("attention").status("cpu")["native_cpu"]
    assert not ok and "shardfuse._native" in why
    q, k, v = _inputs()
    with pytest.raises(NotImplementedError, match="shardfuse._native"):
        sf.flash_attention(q, k, v, implementation="native_cpu")
    out = sf.flash_attention(q, k, v, causal=True, implementation=("native_cpu", "xla"))
    ref = sf.attention_reference(q, k, v, causal=True)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_switched_off_build_is_named(monkeypatch, tmp_path):
    note = tmp_path / "_native_build.txt"
    note.write_text("the build was switched off (SHARDFUSE_NATIVE=0)\n")

    class Files:
        def joinpath(self, name):
            return tmp_path / name

    monkeypatch.setattr(native_cpu.importlib.resources, "files", lambda package: Files())
    assert "SHARDFUSE_NATIVE=0" in native_cpu._why_not_built()


needs_native = pytest.mark.skipif(
    not native_cpu.status("cpu")[0], reason=native_cpu.status("cpu")[1]
)


def _counting_native(monkeypatch):
    """A list that grows by one for each native forward traced."""
    calls = []
    forward = native_cpu.forward

    def counting(*args, **kwargs):
        out = forward(*args, **kwargs)  # raises (and is not counted) where it declines
        calls.append(1)
        return out

    monkeypatch.setattr(native_cpu, "forward", counting)
    flash = native_cpu.protocol.differentiable(counting, native_cpu.backward)
    monkeypatch.setattr(native_cpu, "_flash", flash)
    return calls


@needs_native
@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_partitioned_operands_go_to_xla_and_shard_map_runs_native(monkeypatch, axis_type):
    """The custom calls have no partitioning rule: on operands XLA partitions (a batch
    sharded over an Auto or Explicit mesh axis, outside shard_map) XLA would gather them
    onto every device (Auto) or refuse (Explicit). There the default runs `xla`, keeping
    the batch sharding, and `implementation="native_cpu"` alone says why it cannot run;
    inside shard_map the kernels run per device, with values and gradients as one device's."""
    kind = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}
    mesh = jax.make_mesh((2,), ("data",), axis_types=(kind[axis_type],), devices=jax.devices()[:2])
    q, k, v = _inputs(T=24, S=24)
    spec = jax.sharding.PartitionSpec("data")
    sharding = jax.sharding.NamedSharding(mesh, spec)
    qs, ks, vs = (jax.device_put(x, sharding) for x in (q, k, v))
    want = sf.attention_reference(q, k, v, causal=True)
    calls = _counting_native(monkeypatch)
    with jax.set_mesh(mesh):
        if axis_type == "auto":  # (the xla backend's Explicit batch sharding: not this test's)
            out = jax.jit(lambda q, k, v: sf.flash_attention(q, k, v, causal=True))(qs, ks, vs)
            assert not calls and out.sharding.is_equivalent_to(sharding, out.ndim)
            np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
        with pytest.raises(NotImplementedError, match=r"partitioned over mesh axes \['data'\]"):
            jax.jit(
                lambda q, k, v: sf.flash_attention(q, k, v, implementation="native_cpu")
            )(qs, ks, vs)  # fmt: skip

        def per_device(q, k, v):
            return sf.flash_attention(q, k, v, causal=True)

        local = jax.shard_map(per_device, in_specs=spec, out_specs=spec)
        out, grads = jax.jit(
            jax.value_and_grad(lambda q, k, v: (local(q, k, v) ** 2).sum(), argnums=(0, 1, 2))
        )(qs, ks, vs)  # fmt: skip
    assert calls, "inside shard_map the default did not run native_cpu"
    ref, ref_grads = jax.value_and_grad(
        lambda q, k, v: (sf.attention_reference(q, k, v, causal=True) ** 2).sum(), argnums=(0, 1, 2)
    )(q, k, v)  # fmt: skip
    np.testing.assert_allclose(out, ref, rtol=1e-5)
    for name, a, e in zip("qkv", grads, ref_grads, strict=True):
        assert a.sharding.is_equivalent_to(sharding, a.ndim), (name, a.sharding)
        np.testing.assert_allclose(a, e, atol=2e-5, rtol=2e-5, err_msg=f"d{name}")


@needs_native
@pytest.mark.parametrize("implementation", [None, "native_cpu", ("native_cpu", "xla")])
def test_default_and_named_run_native(monkeypatch, implementation):
    """By default (None) or by name, the C++ kernels run where they are built."""
    calls = _counting_native(monkeypatch)
    q, k, v = _inputs()
    sf.flash_attention(q, k, v, implementation=implementation)
    assert calls, f"implementation={implementation!r} on CPU did not run native_cpu"


@needs_native
def test_float16_falls_back_to_xla():
    q, k, v = _inputs(jnp.float16)
    with pytest.raises(NotImplementedError, match="float32 and bfloat16"):
        sf.flash_attention(q, k, v, implementation="native_cpu")
    out = sf.flash_attention(q, k, v, causal=True, implementation=("native_cpu", "xla"))
    assert out.dtype == jnp.float16 and bool(jnp.isfinite(out).all())


@needs_native
def test_malformed_custom_call_is_an_error_not_a_crash():
    q, k, v = _inputs()
    k = k[..., :16]  # head dims differ: api.py would refuse; the handler must too
    pos = jnp.arange(40, dtype=jnp.int32)
    call = jax.ffi.ffi_call(
        "shardfuse_attention_forward",
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((2, 4, 40), jnp.float32)),
    )
    seg = jnp.zeros((1,), jnp.int32)
    with pytest.raises(Exception, match="H % K|\\[B, S, K, D\\]"):
        jax.block_until_ready(
            call(q, k, k, pos, pos[:16], seg, seg, causal=np.bool_(False),
                 window_left=np.int64(-1), window_right=np.int64(-1), softcap=np.float32(0),
                 scale=np.float32(1), has_segments=np.bool_(False))
        )  # fmt: skip


@needs_native
def test_matches_xla_under_vmap_and_jit_grad():
    q, k, v = _inputs(T=33, S=65)

    def loss(implementation, q, k, v):
        out = sf.flash_attention(
            q, k, v, causal=True, window=(16, 4), implementation=implementation
        )
        return jnp.sum(out**2)

    grads = {
        name: jax.jit(jax.grad(lambda q, k, v, n=name: loss(n, q, k, v), argnums=(0, 1, 2)))(
            q, k, v
        )
        for name in ("native_cpu", "reference")
    }
    for a, b in zip(grads["native_cpu"], grads["reference"], strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)
    batched = jax.vmap(lambda q, k, v: sf.flash_attention(q, k, v, implementation="native_cpu"))
    out = batched(q[:, None], k[:, None], v[:, None])[:, 0]
    np.testing.assert_allclose(out, sf.attention_reference(q, k, v), atol=1e-5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_large_unmasked_tiles_match_the_reference(softcap):
    """Unmasked problems with T >= 256 and S >= 1024 run 128 x 256 tiles (`use_full_tiles` in
    native/attention.h), which the shared body's small cases never reach. Odd lengths pad
    both tile axes; whole tiles and D a multiple of the vector width skip the zeroing of the
    packed operands and reuse the pooled buffers the padded problem left (so stale values
    must never be read). Values, lse and gradients (a nonzero lse cotangent included) against
    the reference."""

    def run(implementation, q, k, v, d_out, d_lse):
        def attend(q, k, v):
            return sf.flash_attention(
                q, k, v, logit_softcap=softcap, return_lse=True, implementation=implementation
            )

        (out, lse), vjp = jax.vjp(attend, q, k, v)
        return (out, lse, *vjp((d_out, d_lse)))

    for T, S, D in ((263, 1031, 24), (256, 1024, 32)):  # padded, then whole tiles
        q, k, v = (x[:1] for x in _inputs(T=T, S=S, H=4, K=2, D=D))
        d_out = jax.random.normal(jax.random.key(3), q.shape)
        d_lse = jax.random.normal(jax.random.key(4), (1, 4, T))
        actual, expected = (
            jax.jit(functools.partial(run, name))(q, k, v, d_out, d_lse)
            for name in ("native_cpu", "reference")
        )
        for name, a, e in zip(("out", "lse", "dq", "dk", "dv"), actual, expected, strict=True):
            tol = 1e-5 if name in ("out", "lse") else 2e-5
            np.testing.assert_allclose(a, e, atol=tol, rtol=tol, err_msg=f"{name} T={T}")


@needs_native
def test_backward_reads_out_and_d_out_in_their_own_dtype():
    """The kernel forms delta = rowsum(d_out * out) - d_lse itself, reading out and d_out each
    in its own dtype: a ring passes its float32 merged output beside bfloat16 q, k, v. The
    gradients match the same backward given both in float32 (to float32 rounding)."""
    from shardfuse.kernels.attention import base, native_cpu

    q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(T=40, S=72, H=4, K=2, D=32))
    T, S = q.shape[1], k.shape[1]
    config = base.AttentionConfig(causal=True, window=None, logit_softcap=None, scale=32**-0.5)
    pos_q, pos_kv = jnp.arange(T, dtype=jnp.int32), jnp.arange(S, dtype=jnp.int32)
    seg = None  # no segment ids
    out, lse = native_cpu.forward(config, q, k, v, pos_q, pos_kv, seg, seg)
    out32 = out.astype(jnp.float32) + 1e-3 * jax.random.normal(jax.random.key(5), out.shape)
    d_out = jax.random.normal(jax.random.key(6), out.shape)
    d_lse = jax.random.normal(jax.random.key(7), lse.shape)

    def grads(out, d_out):
        return native_cpu.backward(
            config, q, k, v, pos_q, pos_kv, seg, seg, out, lse, d_out, d_lse
        )  # fmt: skip

    mixed = grads(out32, d_out.astype(jnp.bfloat16))
    # The same numbers, every operand float32 (q, k, v too, so that one kernel path runs).
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    want = native_cpu.backward(
        config, q32, k32, v32, pos_q, pos_kv, seg, seg, out32,
        lse, d_out.astype(jnp.bfloat16).astype(jnp.float32), d_lse,
    )  # fmt: skip
    for name, a, e in zip(("dq", "dk", "dv"), mixed, want, strict=True):
        assert a.dtype == jnp.float32, name
        np.testing.assert_allclose(a, e, atol=1e-5, rtol=1e-5, err_msg=name)


# Run in a fresh process: 8 CPU devices, 64 kernel threads each, and an address-space limit
# set after compiling that leaves room for a few thread stacks only.
_THREADS_REFUSED = """
import os, resource
os.environ["SHARDFUSE_NATIVE_THREADS"] = "64"
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp, numpy as np
import shardfuse as sf

mesh, spec = jax.make_mesh((8,), ("d",)), jax.sharding.PartitionSpec("d")

def per_device(implementation):
    def f(q, d_out):
        attend = lambda q: sf.flash_attention(q, q, q, causal=True, implementation=implementation)
        out, vjp = jax.vjp(attend, q)
        return out, *vjp(d_out)
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))

keys = jax.random.split(jax.random.key(0), 2)
q, d_out = (jax.device_put(jax.random.normal(key, (8, 200, 2, 32)),
                           jax.sharding.NamedSharding(mesh, spec)) for key in keys)
expected = jax.block_until_ready(per_device("reference")(q, d_out))
native = per_device("native_cpu").lower(q, d_out).compile()
with open("/proc/self/status") as status:
    size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))
# 8 devices x up to 8 threads x 8 MiB stacks do not fit in 256 MiB more.
resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20), resource.RLIM_INFINITY))
actual = jax.block_until_ready(native(q, d_out))
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
for a, e in zip(actual, expected, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=2e-5, rtol=2e-5)
print("ok")
"""


@needs_native
@pytest.mark.skipif(
    "libasan" in os.environ.get("LD_PRELOAD", ""), reason="an address-space limit breaks ASan"
)
def test_threads_the_system_refuses_run_on_the_caller():
    """Custom calls on 8 devices at once, each asking for 64 threads, where the address space
    has room for only a few thread stacks: the threads that cannot start run their share on
    the calling thread, and the results match the reference. Before `run_threads` caught
    the failed start, the process aborted in std::terminate with no Python traceback (the
    xdist worker that died in the slow suite, 2026-11-25, is consistent with this)."""
    result = subprocess.run(
        [sys.executable, "-c", _THREADS_REFUSED], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
        f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    )


_DEFAULT_THREADS = """
import os, sys
os.environ.pop("SHARDFUSE_NATIVE_THREADS", None)
import jax
jax.config.update("jax_num_cpu_devices", int(sys.argv[1]))
from shardfuse.kernels.attention import native_cpu
info, cores = native_cpu.build_info(), len(os.sched_getaffinity(0))
print(info["threads"], native_cpu.default_threads(), cores)
"""


@needs_native
@pytest.mark.parametrize("devices", [1, 8])
def test_the_kernels_split_the_cores_between_the_processs_cpu_devices(devices):
    """Unless SHARDFUSE_NATIVE_THREADS says otherwise, each call runs on the process's cores
    over its CPU devices (at least one thread): the devices of a simulated mesh run at once,
    and a second thread per call on 8 devices of 2 cores only waits for a core."""
    env = {k: v for k, v in os.environ.items() if k != "SHARDFUSE_NATIVE_THREADS"}
    result = subprocess.run(
        [sys.executable, "-c", _DEFAULT_THREADS, str(devices)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    threads, default, cores = map(int, result.stdout.split()[-3:])
    assert threads == default == max(1, cores // devices)
