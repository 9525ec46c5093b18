"""Asyncio channels over ZeroMQ: credit-based flow control, acks, redelivery, de-duplication."""

from pipeline.transport.channel import ChannelConfig, ChannelStats
from pipeline.transport.control import ControlClient, ControlServer
from pipeline.transport.queue_client import Delivery, QueueClient
from pipeline.transport.queue_server import QueueServer

__all__ = [
    "ChannelConfig",
    "ChannelStats",
    "ControlClient",
    "ControlServer",
    "Delivery",
    "QueueClient",
    "QueueServer",
]
