"""The HLO boundary-bytes meter (``_links.hlo_sent_bytes``): a permute is a boundary send by
the mesh's stage axis and by being the program's ``ppermute``, not by device-id steps; each
pair's bytes count by its direction (a 1F1B tick's permute carries both)."""

import jax
import jax.numpy as jnp
import pytest

from jaxcomp import comm
from jaxcomp import compressors as C
from jaxcomp import pipeline
from jaxcomp.pipeline import _links

PPERMUTE = 'metadata={op_name="jit(step)/shard_map/ppermute" stack_frame_id=1}'
SLICE = 'metadata={op_name="jit(step)/slice" stack_frame_id=2}'


def _module(*permutes):
    """A module of 8 partitions holding ``(shape, pairs, metadata)`` permutes."""
    lines = []
    for i, (shape, pairs, meta) in enumerate(permutes):
        listed = ",".join(f"{{{s},{d}}}" for s, d in pairs)
        lines.append(
            f"  %cp.{i} = {shape} collective-permute(%x), channel_id={i + 1}, "
            f"source_target_pairs={{{listed}}}, {meta}"
        )
    return "\n".join(
        [
            "HloModule jit_step, num_partitions=8",
            "",
            "ENTRY %main (x: u8[40]) -> u8[40] {",
            "  %x = u8[40]{0} parameter(0)",
            *lines,
            "  ROOT %o = u8[40]{0} copy(%x)",
            "}",
        ]
    )


def _meshes():
    devices = jax.devices()[:8]
    return (
        comm.make_mesh([("data", 2), ("stage", 4)], devices),  # position = 4 data + stage
        comm.make_mesh([("stage", 4), ("data", 2)], devices),  # position = 2 stage + data
    )


def test_meter_classifies_by_the_stage_axis_and_the_ppermute():
    data_stage, stage_data = _meshes()
    # (data, stage): a tick's forward and backward moves in both replicas; the partitioner's
    # gather of stage rows to stage 0 (unpacked gradients: (1, 0) steps -1 like a backward
    # send, (2, 0) by -2); a data-axis ppermute
    text = _module(
        ("u8[12]{0}", [(0, 1), (1, 2), (4, 5), (5, 6)], PPERMUTE),
        ("u8[40]{0}", [(1, 0), (5, 4)], PPERMUTE),
        ("f32[1,272]{1,0}", [(1, 0), (5, 4)], SLICE),
        ("f32[1,272]{1,0}", [(2, 0), (6, 4)], SLICE),
        ("u8[40]{0}", [(0, 4), (4, 0)], PPERMUTE),
    )
    sent = _links.hlo_sent_bytes(text, data_stage)
    assert sent == {
        "total": 4 * 12 + 2 * 40 + 4 * 1088 + 2 * 40,
        "forward": 4 * 12,
        "backward": 2 * 40,
        "other": 4 * 1088 + 2 * 40,
        "permutes": 2,
    }
    # (stage, data): a boundary steps by the data size, a data-axis ppermute by 1
    text = _module(
        ("u8[12]{0}", [(0, 2), (1, 3), (2, 4), (3, 5)], PPERMUTE),
        ("u8[40]{0}", [(2, 0), (3, 1)], PPERMUTE),
        ("u8[8]{0}", [(0, 1), (2, 3), (4, 5), (6, 7)], PPERMUTE),
        ("u8[8]{0}", [(1, 0), (3, 2)], PPERMUTE),
        ("u8[8]{0}", [(0, 4), (1, 5)], PPERMUTE),  # two stages up: no boundary
        # up and down in one permute (1F1B's merged tick): each pair by its direction
        ("u8[8]{0}", [(0, 2), (3, 1)], PPERMUTE),
        ("u8[8]{0}", [(0, 2), (1, 5)], PPERMUTE),  # one pair two stages up: no boundary
    )
    sent = _links.hlo_sent_bytes(text, stage_data)
    assert (sent["forward"], sent["backward"], sent["other"]) == (56, 88, 4 * 8 + 3 * 2 * 8)
    assert sent["permutes"] == 3


def test_meter_refuses_a_text_it_cannot_classify():
    data_stage, _ = _meshes()
    text = _module(("u8[40]{0}", [(1, 0), (5, 4)], PPERMUTE))
    with pytest.raises(ValueError, match="no op_name metadata"):
        _links.hlo_sent_bytes(text.replace(", " + PPERMUTE, ""), data_stage)
    with pytest.raises(ValueError, match="8 partitions, the mesh has 4 devices"):
        _links.hlo_sent_bytes(text, pipeline.pipeline_mesh(4, jax.devices()[:4]))
    outside = text.replace("num_partitions=8", "num_partitions=4").replace("{5,4}", "{3,4}")
    with pytest.raises(ValueError, match=r"pair \(3, 4\) names a device outside"):
        _links.hlo_sent_bytes(outside, pipeline.pipeline_mesh(4, jax.devices()[:4]))


#: stateless TopK both ways; GPipe's program on the same mesh and MLP is metered by
#: test_cold_sends.py (a per-sample link: AQ-SGD forward, per-sample EF backward)
LINK = pipeline.link(C.top_k(0.25), C.top_k(0.5))


def test_data_by_stage_meter_is_replicas_times_step_bytes(tools):
    """On a (data 2 x stage 3) mesh, boundary bytes are R times one replica's payloads
    (``check_data_stage_meter``, tests/pipeline/conftest.py), under 1F1B: a tick's permute
    carries both directions, each pair counted by its own (GPipe: test_cold_sends.py)."""
    schedule = "1f1b"
    mlp = tools.make_mlp(num_microbatches=3, microbatch=1, num_stages=3)
    batch = {k: jnp.concatenate([v, v]) for k, v in mlp.batch.items()}  # 2 x 3 rows
    mesh = pipeline.pipeline_mesh(3, jax.devices()[:6])
    pipe = pipeline.distribute(
        mlp.model, pipeline.PipelineConfig(mlp.M, LINK, schedule=schedule), mesh
    )
    states = pipe.init(mlp.params, batch)
    step = jax.jit(pipe.step, static_argnames="compress")
    text = step.lower(mlp.params, batch, states, jax.random.key(0), True).compile().as_text()
    tools.check_data_stage_meter(text, pipe, mlp.params, batch, mesh)
