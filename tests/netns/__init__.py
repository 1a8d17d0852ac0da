"""Tests of the network-namespace test bed (tests/helpers/netns.py); they skip where namespaces are unavailable."""
