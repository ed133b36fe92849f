"""crowdchat sessions: durable chat history in SQLite and KV snapshots on disk."""
