"""The error a collective raises on every process instead of hanging or mixing up data."""


class DistributedOperationException(Exception):
    """A collective cannot run: its inputs disagree across processes (shapes, dtypes or devices), or some
    processes cannot take part (the last step of an uneven epoch, see `accel.wire.uneven`)."""
