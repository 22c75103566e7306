"""Address filters for the firewall role, built on Python's ``ipaddress`` (no netaddr needed).

Every filter takes CIDR strings as a user writes them in ``firewall_lan_cidrs`` / ``firewall_admin_cidrs``
("10.231.0.0/24", "fd00:1::/64", or a bare address meaning a single host).
"""
import ipaddress

from ansible.errors import AnsibleFilterError


def _network(cidr):
    """Parse one CIDR string strictly -> ipaddress.IPv4Network | IPv6Network.

    Raises ValueError with a message that names the value and, for host bits set, the network meant."""
    text = str(cidr).strip()
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        try:
            loose = ipaddress.ip_network(text, strict=False)
        except ValueError:
            raise ValueError(f"'{text}' is not an IPv4 or IPv6 network in CIDR form ({exc})") from None
        raise ValueError(f"'{text}' has host bits set; write '{loose}'") from None


def firewall_cidr_problems(cidrs):
    """List what is wrong with ``cidrs`` (list of str) -> list of str, empty when every entry parses.

    Each message names the offending value and how to fix it; the role's assert step prints them."""
    if not isinstance(cidrs, (list, tuple)):
        return [f"expected a list of CIDR strings, got {type(cidrs).__name__} {cidrs!r}"]
    problems = []
    for cidr in cidrs:
        try:
            _network(cidr)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def firewall_cidrs_by_family(cidrs, version):
    """Normalised CIDR strings of one IP version -> list of str.

    ``version`` is 4 or 6.  Raises AnsibleFilterError on an unparsable entry (run the assert step first)."""
    if int(version) not in (4, 6):
        raise AnsibleFilterError(f"firewall_cidrs_by_family: version must be 4 or 6, got {version!r}")
    out = []
    for cidr in cidrs:
        try:
            net = _network(cidr)
        except ValueError as exc:
            raise AnsibleFilterError(str(exc)) from None
        if net.version == int(version):
            out.append(str(net))
    return out


# The most addresses a LAN can hold, per IP version: all of RFC 1918's private blocks together
# (10/8 + 172.16/12 + 192.168/16) and RFC 4193's unique local fc00::/7. Judged by the addresses the
# entries cover together, so 0.0.0.0/1 + 128.0.0.0/1 counts as the whole internet, like 0.0.0.0/0.
_WIDEST_LAN = {4: (2**24 + 2**20 + 2**16, "all RFC 1918 private networks together"),
               6: (2**121, "fc00::/7")}


def firewall_any_networks(cidrs):
    """What in ``cidrs`` (list of str) opens the box to more than a LAN -> list of str, empty when nothing.

    Per IP version, the parseable entries are merged (overlaps counted once); when they cover more
    addresses than _WIDEST_LAN allows for that version, one message names the entries and the count.
    Unparseable entries are left to firewall_cidr_problems."""
    found = []
    for version, (limit, limit_name) in _WIDEST_LAN.items():
        nets = [_network(c) for c in cidrs if not firewall_cidr_problems([c]) and _network(c).version == version]
        merged = list(ipaddress.collapse_addresses(nets))
        covered = sum(n.num_addresses for n in merged)
        if covered > limit:
            found.append(f"{' + '.join(str(n) for n in nets)} ({covered:,} IPv{version} addresses, more than "
                         f"{limit_name} hold)")
    return found


def firewall_cidrs_contain(cidrs, address):
    """True when ``address`` (str, IPv4, IPv6 or IPv4-mapped IPv6, optional %zone) lies in any of
    ``cidrs`` (list of str), else False.  Raises AnsibleFilterError when ``address`` does not parse."""
    text = str(address).strip().split("%", 1)[0]
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        raise AnsibleFilterError(f"'{address}' is not an IP address") from None
    if addr.version == 6 and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    for cidr in cidrs:
        try:
            net = _network(cidr)
        except ValueError as exc:
            raise AnsibleFilterError(str(exc)) from None
        if net.version == addr.version and addr in net:
            return True
    return False


def firewall_cidrs_outside(cidrs, allowed):
    """The entries of ``cidrs`` (list of str) that reach beyond ``allowed`` (list of str) -> list of str.

    An entry is inside when one entry of ``allowed`` of the same IP version contains it entirely (a bare
    address is one host); unparseable entries are left to firewall_cidr_problems. Used to keep a box
    behind a front gateway reachable from the front only."""
    nets = [_network(a) for a in allowed if not firewall_cidr_problems([a])]
    outside = []
    for cidr in cidrs:
        if firewall_cidr_problems([cidr]):
            continue
        net = _network(cidr)
        if not any(net.version == a.version and net.subnet_of(a) for a in nets):
            outside.append(str(net))
    return outside


class FilterModule:
    """Ansible entry point."""

    def filters(self):
        """Map filter names to functions."""
        return {
            "firewall_cidr_problems": firewall_cidr_problems,
            "firewall_cidrs_by_family": firewall_cidrs_by_family,
            "firewall_any_networks": firewall_any_networks,
            "firewall_cidrs_contain": firewall_cidrs_contain,
            "firewall_cidrs_outside": firewall_cidrs_outside,
        }
