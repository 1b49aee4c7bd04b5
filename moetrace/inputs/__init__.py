"""What comes in: prompt lines and their shards, text <-> token ids, stdin read-ahead."""
