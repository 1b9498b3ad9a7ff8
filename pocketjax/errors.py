"""Typed errors: every failure a caller can cause has its own class, so callers can catch precisely."""


class PocketJaxError(Exception):
    """Base class of every error pocketjax raises on purpose."""


class ConfigError(PocketJaxError, ValueError):
    """A model or engine configuration is unsupported, missing a field, or contradicts itself."""


class CheckpointError(PocketJaxError):
    """A checkpoint folder or file is missing, truncated, corrupt, or does not match its config."""


class RequestError(PocketJaxError, ValueError):
    """A request is invalid: empty or too long prompt, token outside the vocabulary, unknown id."""


class SamplingError(RequestError):
    """A sampling parameter is out of its documented range."""


class StructuredOutputError(RequestError):
    """A structured-output constraint does not compile (a bad JSON schema, regex or grammar), the engine has no
    tokenizer to compile it with, or the grammar reached a point where no token of the vocabulary is allowed."""


class NumericsError(PocketJaxError, ArithmeticError):
    """The model computed non-finite logits for a request (a broken checkpoint, or a hook that made them NaN): that
    request fails, the others sharing its steps go on."""


class CapacityError(PocketJaxError):
    """No free slot, the waiting queue is full, or the memory asked for exceeds what the device has free."""


class StoppedError(PocketJaxError, RuntimeError):
    """The scheduler was stopped (or its loop died): it takes no request until it is started again."""


class DistributedError(StoppedError):
    """A process of a multi-process job died or stopped answering (or this one could not follow process 0): the
    job cannot continue, so this process's scheduler stops and every open request fails with this error."""
