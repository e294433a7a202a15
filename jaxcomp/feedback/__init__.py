"""Error-feedback channels: a codec plus explicit sender and receiver state.

See :class:`Channel` for the contract.
"""

from jaxcomp.feedback._channel import Channel
from jaxcomp.feedback._channel import as_channel
from jaxcomp.feedback._channel import plain
from jaxcomp.feedback._ef21 import EF21RecvState
from jaxcomp.feedback._ef21 import EF21SendState
from jaxcomp.feedback._ef21 import aq_sgd
from jaxcomp.feedback._ef21 import ef21
from jaxcomp.feedback._error_feedback import ErrorFeedbackState
from jaxcomp.feedback._error_feedback import error_feedback

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
