"""``--strategy single``: one process on one device; the protocol's defaults as they are."""

from visiontune.cluster.strategies.base import Strategy, register


@register
class Single(Strategy):
    name = "single"
    description = "one process on one device"
    one_device = True
