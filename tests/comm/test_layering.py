"""comm knows no codec or channel type: it runs the protocol a codec or channel hands it."""

import ast
import pathlib

from jaxcomp import compressors
from jaxcomp import feedback

COMM = pathlib.Path(__file__).parents[2] / "jaxcomp" / "comm"

# the contracts comm may use: the types every codec/channel shares, and generic helpers
CONTRACT = {
    "Codec",
    "CodecState",
    "EmptyState",
    "PerWorker",
    "ReduceProtocol",
    "Reduction",
    "add_decoded",
    "compress_and_decode",
    "compress_into",
    "decode_sum",
    "dense_bytes",
    "payload_shape",
    "wire_bytes",
    "axis_size",
    "per_worker",
    "this_worker",
    "worker_key",
    "Channel",
    "Feedback",
    "as_channel",
    "plain",
    "compensate",
}


def specific_names() -> set[str]:
    """Public names of compressors and feedback that belong to one codec or channel."""
    names = set(compressors.__all__) | set(feedback.__all__)
    return names - CONTRACT


def referenced(source: str) -> set[str]:
    """Names a module's *code* refers to (names, attributes, imports; not strings or docs)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.alias):
            out.add(node.name.rsplit(".", 1)[-1])
    return out


def test_comm_code_refers_to_no_codec_or_channel_type():
    specific = specific_names()
    found = {
        path.name: sorted(referenced(path.read_text()) & specific)
        for path in sorted(COMM.glob("*.py"))
    }
    found = {k: v for k, v in found.items() if v}
    assert not found, f"comm refers to specific codecs or channels: {found}"


def test_the_check_would_catch_a_type_test():
    specific = specific_names()
    for line in (
        "isinstance(recv, feedback.EF21RecvState)",
        "isinstance(payload, compressors.RandKPayload)",
        "from jaxcomp.compressors import power_sgd",
        "isinstance(state, feedback.ErrorFeedbackState)",
        "compressors.effective_rank(shape, 2)",
    ):
        assert referenced(line) & specific, line
