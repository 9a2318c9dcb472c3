"""Tiered, time-partitioned storage of the time series: raw 1 Hz rows for a hot window, 10 s and 1 min rollups for
weeks, PostgreSQL partitions by day (retention drops a partition), and the read side that picks the tier a range
needs. See docs/scaling-storage.md."""
