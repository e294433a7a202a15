"""The HLO wire-byte meter: synthetic modules with known answers, and real compiled functions."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm

SYNTHETIC = """\
HloModule jit_f, entry_computation_layout={(f32[8]{0})->f32[8]{0}}, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%inner_body (p: (s32[], u8[16])) -> (s32[], u8[16]) {
  %p = (s32[], u8[16]{0}) parameter(0)
  %v = u8[16]{0} get-tuple-element(%p), index=1
  %cp = u8[16]{0} collective-permute(%v), channel_id=1, source_target_pairs={{0,1},{1,2}}, metadata={op_name="jit(f)/while/body/ppermute" stack_frame_id=3}
  ROOT %t = (s32[], u8[16]{0}) tuple(%i, %cp)
}

%inner_cond (p: (s32[], u8[16])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

%outer_body (p: (s32[], u8[16])) -> (s32[], u8[16]) {
  %w = (s32[], u8[16]{0}) while(%p), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"5"}}
  %ar = (f32[10]{0}, bf16[4]{0}) all-reduce(%x, %y), channel_id=2, replica_groups=[2,2]<=[4], to_apply=%add
  ROOT %r = (s32[], u8[16]{0}) tuple(%i, %v)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %w2 = (s32[], u8[16]{0}) while(%t0), condition=%inner_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  %ag = s32[4,6]{1,0} all-gather(%z), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}
  %rs = f32[2]{0} reduce-scatter(%q), channel_id=4, replica_groups={}, dimensions={0}, to_apply=%add
  %ags = (f32[3]{0}, f32[12]{0}) all-gather-start(%u), channel_id=5, replica_groups=[1,4]<=[4]
  %agd = f32[12]{0} all-gather-done(%ags)
  ROOT %o = f32[8]{0} copy(%x)
}
"""


def test_synthetic_module_known_answer():
    report = comm.collective_report(SYNTHETIC)
    by_name = {r.name: r for r in report.records}
    assert by_name["cp"].executions == 15 and by_name["cp"].bytes_per_execution == 16
    assert by_name["cp"].op_name == "jit(f)/while/body/ppermute" and by_name["ar"].op_name == ""
    assert by_name["ar"].executions == 3 and by_name["ar"].bytes_per_execution == 40 + 8
    assert by_name["ar"].group_size == 2
    assert by_name["ag"].bytes_per_execution == 4 * 6 * 4 / 4
    assert by_name["rs"].bytes_per_execution == 2 * 4 * 4  # empty groups: all 4 partitions
    assert by_name["ags"].bytes_per_execution == 12  # async start: the operand
    assert "agd" not in by_name
    assert report.total_bytes == 15 * 16 + 3 * 48 + 24 + 32 + 12
    assert report.bytes_by_kind()["collective-permute"] == 240
    assert report.dtypes("all-reduce") == {"f32", "bf16"}
    assert report.unknown_trip_counts == ()
    assert "total" in report.table()


def test_unknown_trip_count_is_flagged():
    text = SYNTHETIC.replace(', backend_config={"known_trip_count":{"n":"3"}}', "")
    report = comm.collective_report(text)
    assert len(report.unknown_trip_counts) == 1
    assert {r.name: r for r in report.records}["cp"].executions == 5


@pytest.fixture(scope="module")
def mesh():
    return comm.make_mesh([("x", 4)], devices=jax.devices()[:4])


def test_real_scan_of_ppermute_and_psum(mesh):
    def body(x):
        def tick(c, _):
            return lax.ppermute(c, "x", [(i, (i + 1) % 4) for i in range(4)]), None

        y, _ = lax.scan(tick, x.astype(jnp.int8), None, length=7)
        return lax.psum(x, "x") + y.astype(jnp.float32)

    x = jax.device_put(jnp.ones((4, 32)), NamedSharding(mesh, P("x")))
    f = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    report = comm.measure_collectives(f, x)
    kinds = report.bytes_by_kind()
    assert kinds["collective-permute"] == 7 * 32  # int8, 7 ticks
    # the JAX primitive it came from (the pipeline's meter tells its ppermutes by it)
    permute = next(r for r in report.records if r.kind == "collective-permute")
    assert permute.op_name.rsplit("/", 1)[-1] == "ppermute"
    assert kinds["all-reduce"] == 32 * 4


def test_real_all_gather_counts_the_contribution(mesh):
    x = jax.device_put(jnp.ones((4, 10), jnp.uint8), NamedSharding(mesh, P("x")))
    f = jax.shard_map(
        lambda v: lax.all_gather(v, "x", tiled=True, to="invarying"),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P(),
    )
    report = comm.measure_collectives(f, x)
    assert report.bytes_by_kind() == {"all-gather": 10.0}
