"""pipeswarm's peer: the daemon, stage runtime, routing, gossip, recovery, dashboard and CLI."""

__version__ = "0.1.0"
