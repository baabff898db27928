"""One optimizer step: the device actors, the sync server, their messages and mailboxes, the per-step agreement."""
