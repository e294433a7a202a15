"""Error-feedback channels: a codec plus explicit sender and receiver state.

See :class:`Channel` for the contract.
"""

from jaxcomp.feedback._channel import Channel, as_channel, plain
from jaxcomp.feedback._ef21 import EF21RecvState, EF21SendState, aq_sgd, ef21
from jaxcomp.feedback._error_feedback import ErrorFeedbackState, error_feedback

__all__ = (
    "Channel",
    "EF21RecvState",
    "EF21SendState",
    "ErrorFeedbackState",
    "aq_sgd",
    "as_channel",
    "ef21",
    "error_feedback",
    "plain",
)
