"""MindScience namespace: only ``mindscience.distributed`` lives in this distribution."""
