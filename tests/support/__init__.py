"""Helpers the tests share (not tests): fake servers, process markers, strategies."""
