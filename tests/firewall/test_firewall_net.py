"""Unit tests of roles/firewall/filter_plugins/firewall_net.py (run: .venv/bin/pytest tests/firewall)."""
import importlib.util
import ipaddress
from pathlib import Path

import pytest
from ansible.errors import AnsibleFilterError
from hypothesis import assume, given
from hypothesis import strategies as st

_PATH = Path(__file__).resolve().parents[2] / "roles/firewall/filter_plugins/firewall_net.py"
_SPEC = importlib.util.spec_from_file_location("firewall_net", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
net = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(net)


@pytest.mark.parametrize("good", ["10.231.0.0/24", "fd31:231::/64", "192.168.1.7", "::1", "0.0.0.0/0"])
def test_good_cidrs_have_no_problems(good):
    assert net.firewall_cidr_problems([good]) == []


@pytest.mark.parametrize("bad, says", [
    ("10.231.0.300/24", "'10.231.0.300/24' is not an IPv4 or IPv6 network"),
    ("10.231.0.5/24", "'10.231.0.5/24' has host bits set; write '10.231.0.0/24'"),
    ("fd31:231::1/64", "write 'fd31:231::/64'"),
    ("lan", "'lan' is not an IPv4 or IPv6 network"),
    ("10.0.0.0/33", "'10.0.0.0/33' is not"),
])
def test_bad_cidrs_are_named_with_the_fix(bad, says):
    problems = net.firewall_cidr_problems(["10.0.0.0/8", bad])
    assert len(problems) == 1 and says in problems[0]


def test_not_a_list_is_a_problem():
    assert "expected a list" in net.firewall_cidr_problems("10.0.0.0/8")[0]


def test_split_by_family_normalises():
    cidrs = ["10.231.0.0/24", "FD31:0231::/64", "10.0.0.1"]
    assert net.firewall_cidrs_by_family(cidrs, 4) == ["10.231.0.0/24", "10.0.0.1/32"]
    assert net.firewall_cidrs_by_family(cidrs, 6) == ["fd31:231::/64"]
    with pytest.raises(AnsibleFilterError):
        net.firewall_cidrs_by_family(["nope"], 4)
    with pytest.raises(AnsibleFilterError):
        net.firewall_cidrs_by_family(cidrs, 5)


def test_any_networks():
    found = net.firewall_any_networks(["10.0.0.0/8", "0.0.0.0/0", "::/0", "junk"])
    assert [m.split(" (")[0] for m in found] == ["10.0.0.0/8 + 0.0.0.0/0", "::/0"]
    assert "4,294,967,296 IPv4 addresses, more than all RFC 1918 private networks together hold" in found[0]


@pytest.mark.parametrize("cidrs", [
    ["0.0.0.0/1", "128.0.0.0/1"],             # the internet in two halves
    ["11.0.0.0/8", "12.0.0.0/8"],             # two public /8s: more than all private space
    ["::/1", "8000::/1"],
    ["fc00::/7", "2001:db8::/32", "::/8"]])
def test_wide_networks_are_judged_by_address_count(cidrs):
    assert net.firewall_any_networks(cidrs)


@pytest.mark.parametrize("cidrs", [
    ["10.0.0.0/8"], ["10.0.0.0/8", "10.1.0.0/16"],  # overlaps count once
    ["192.168.0.0/16", "172.16.0.0/12"], ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"], ["fc00::/7"], ["2001:db8::/32", "fd00::/8"], ["10.231.0.10"]])
def test_lan_sized_networks_pass(cidrs):
    assert net.firewall_any_networks(cidrs) == []


@pytest.mark.parametrize("addr, inside", [
    ("10.231.0.1", True), ("10.231.1.1", False), ("::ffff:10.231.0.9", True),
    ("fd31:231::21", True), ("fd31:231::22", False), ("fe80::1%eth0", False),
])
def test_contains(addr, inside):
    assert net.firewall_cidrs_contain(["10.231.0.0/24", "fd31:231::21/128"], addr) is inside


def test_contains_rejects_garbage_address():
    with pytest.raises(AnsibleFilterError, match="'10.0.0' is not an IP address"):
        net.firewall_cidrs_contain(["10.0.0.0/8"], "10.0.0")


@given(st.ip_addresses(), st.integers(min_value=0, max_value=128))
def test_contains_agrees_with_ipaddress(addr, prefix):
    # An IPv4-mapped IPv6 address is an IPv4 peer on a dual-stack socket; the filter treats it as IPv4
    # (test_contains covers that), so it is outside the plain IPv6 property.
    assume(addr.version == 4 or addr.ipv4_mapped is None)
    prefix = min(prefix, addr.max_prefixlen)
    network = ipaddress.ip_network(f"{addr}/{prefix}", strict=False)
    assert net.firewall_cidr_problems([str(network)]) == []
    assert net.firewall_cidrs_contain([str(network)], str(addr)) is True
    assert net.firewall_cidrs_by_family([str(network)], addr.version) == [str(network)]


def test_outside_names_what_reaches_beyond_the_front():
    """A box behind a front: the LAN reaches beyond the front's address, the front itself and an opted-in
    host do not; an IPv6 entry is never inside an IPv4 one; bad entries are left to firewall_cidr_problems."""
    allowed = ["10.231.0.30", "10.231.0.1/32"]
    assert net.firewall_cidrs_outside(["10.231.0.0/24", "10.231.0.30/32", "10.231.0.1", "::ffff:0:0/96", "nonsense"],
                                      allowed) == ["10.231.0.0/24", "::ffff:0:0/96"]
    assert net.firewall_cidrs_outside(["fd31::/64"], ["fd31::/48"]) == []
    assert net.firewall_cidrs_outside([], allowed) == []
