#!/usr/bin/env bash
# Install what the emulated cluster's round-trip times need (gradwire experiment --rtt / --network):
# vde2 (vde_switch and wirefilter: user-space wires that delay, rate-limit and drop, since this
# kernel has no netem), iputils-ping and iperf3 (the link checks in tests and benchmarks/wan_links.py).
# Debian packages, so root; a machine without apt-get or root is told what is missing and the
# delayed links say so when used. Idempotent.
set -euo pipefail
if command -v wirefilter >/dev/null && command -v vde_switch >/dev/null && command -v ping >/dev/null \
   && command -v iperf3 >/dev/null; then
  echo "install-wan: already installed"
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "install-wan: needs root and apt-get to install vde2, iputils-ping and iperf3 (Debian packages);" \
       "without them gradwire experiment --rtt says what is missing" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q vde2 iputils-ping iperf3 >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q vde2 iputils-ping iperf3 >/dev/null; }
echo "install-wan: vde2, ping and iperf3 installed"
