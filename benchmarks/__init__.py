"""Workloads, load generators and benchmark entry points."""
