"""Scheduling inside an engine process: requests and the policies that plan each step."""
