"""Secure aggregation (SecAgg+) primitives shared by the factory (client) and the central (server) side."""
