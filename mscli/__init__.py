"""``msdist``: plan and verify parallel layouts of distributed MindSpore training."""
