"""The node's nftables table on the host side of its sandboxes' veths (links.py). The sandbox's root has
no CAP_NET_ADMIN in the host's namespace, so nothing inside can change these:

- every TCP connection from a sandbox is redirected to the node's Aether proxy (which reads the original
  destination and decides), and every UDP DNS query, whatever server it names, to Aether's resolver;
- everything else from a sandbox is dropped: other UDP, ICMP, IPv6, a packet whose source address is not
  its own link's (reverse-path check), and anything routed onward (to the host's network or another
  sandbox);
- the proxy's and resolver's ports take nothing from the host's other interfaces (loopback aside).

One table per node, `inet dsec_<node>`, with no per-sandbox rule: a create adds nothing here.
"""
from __future__ import annotations

import re

from aether.links import link_prefix
from aether.nft import Nft, NftError

TABLE_PREFIX = "dsec_"


def table_name(node: str) -> str:
    """The node's table (nft names: letters, digits, '_'; a node id's other characters become '_')."""
    return TABLE_PREFIX + re.sub(r"[^A-Za-z0-9_]", "_", node)


def ruleset(node: str, proxy_port: int, dns_port: int) -> str:
    """The node's table, as one nft transaction that replaces any earlier one of the node."""
    table, links = table_name(node), f'"{link_prefix(node)}*"'
    return f"""
table inet {table}
delete table inet {table}
table inet {table} {{
    chain divert {{
        type nat hook prerouting priority dstnat; policy accept;
        iifname {links} meta nfproto ipv4 meta l4proto tcp redirect to :{proxy_port}
        iifname {links} meta nfproto ipv4 udp dport 53 redirect to :{dns_port}
    }}
    chain from_sandbox {{
        meta nfproto ipv6 drop
        fib saddr . iif oif missing drop
        tcp dport {proxy_port} accept
        udp dport {dns_port} accept
        drop
    }}
    chain inbound {{
        type filter hook input priority filter; policy accept;
        iifname {links} jump from_sandbox
        iifname != "lo" tcp dport {proxy_port} drop
        iifname != "lo" udp dport {dns_port} drop
    }}
    chain onward {{
        type filter hook forward priority filter; policy accept;
        iifname {links} drop
        oifname {links} drop
    }}
}}
"""


def install(node: str, proxy_port: int, dns_port: int) -> None:
    """Put the node's table in place (atomically replacing an earlier one)."""
    with Nft() as nft:
        nft.run(ruleset(node, proxy_port, dns_port))


def remove(node: str) -> None:
    """Drop the node's table (no error when it is not there)."""
    table = table_name(node)
    with Nft() as nft:
        try:
            nft.run(f"table inet {table}\ndelete table inet {table}")
        except NftError:
            pass


def tables() -> list[str]:
    """Names of every DSec node table on the host (the leak check's view)."""
    with Nft() as nft:
        out = nft.run("list tables inet")
    return [line.split()[-1] for line in out.splitlines()
            if line.startswith("table inet ") and line.split()[-1].startswith(TABLE_PREFIX)]
