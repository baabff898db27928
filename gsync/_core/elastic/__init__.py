"""Elastic membership: the store protocol of a change, its watcher thread, the state handed over, and the driver."""
