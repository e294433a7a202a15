"""Error-feedback channels: a codec plus explicit sender and receiver state.

See :class:`Channel` for the contract. Each channel also carries its compensation in reduction
form (:class:`Feedback`), which wraps any multi-worker reduction (:func:`compensate`), so the
data-parallel transforms run the same error feedback on every collective path.
"""

from jaxcomp.feedback._channel import Channel
from jaxcomp.feedback._channel import as_channel
from jaxcomp.feedback._channel import check_sample_ids
from jaxcomp.feedback._channel import plain
from jaxcomp.feedback._compensate import Compensated
from jaxcomp.feedback._compensate import Feedback
from jaxcomp.feedback._compensate import compensate
from jaxcomp.feedback._ef21 import EF21Memory
from jaxcomp.feedback._ef21 import EF21RecvState
from jaxcomp.feedback._ef21 import EF21SendState
from jaxcomp.feedback._ef21 import aq_sgd
from jaxcomp.feedback._ef21 import ef21
from jaxcomp.feedback._ef21 import ef21_reduction
from jaxcomp.feedback._error_feedback import ErrorFeedbackMemory
from jaxcomp.feedback._error_feedback import ErrorFeedbackState
from jaxcomp.feedback._error_feedback import error_feedback
from jaxcomp.feedback._error_feedback import error_feedback_reduction

__all__ = (
    "Channel",
    "Compensated",
    "EF21Memory",
    "EF21RecvState",
    "EF21SendState",
    "ErrorFeedbackMemory",
    "ErrorFeedbackState",
    "Feedback",
    "aq_sgd",
    "as_channel",
    "check_sample_ids",
    "compensate",
    "ef21",
    "ef21_reduction",
    "error_feedback",
    "error_feedback_reduction",
    "plain",
)
