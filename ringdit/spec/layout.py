"""The run spec's ``Layout`` (``ringdit.layout``, where it lives so that ``ringdit.memory`` can take it without
importing the spec) and its config-time helpers, under the names the spec's modules import them by."""

from ringdit.layout import Layout, check_launch_environment, cluster_launcher, device_type, world_size

__all__ = ["Layout", "check_launch_environment", "cluster_launcher", "device_type", "world_size"]
