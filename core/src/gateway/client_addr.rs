//! The client's address: the TCP peer, unless the peer is a proxy the config trusts.
//!
//! Runs once per request, when its head is in and before the front door looks at it.
//! [`client_address`] takes the TCP peer, the head and `server.trusted_proxies` /
//! `server.real_ip_header`, and returns the address everything downstream treats as the
//! client's: a key's `source_subnets`, the access log's `client_addr`. It raises nothing.
//!
//! The rule is nginx's `real_ip` with `real_ip_recursive on`: with no trusted proxies (the
//! default) the peer is the client and the header is not read. When the peer is trusted, the
//! header's addresses are read from the nearest hop back (the last field's last item first):
//! the first one that is not itself a trusted proxy is the client; if every one is trusted, the
//! farthest is. An item that is not an address (`unknown`, a name, garbage) ends the reading:
//! the last address read — a trusted proxy's — is the client, so a client cannot hide behind
//! junk. An address from the header has port 0. The standard forwarding headers are still
//! withheld from the upstream (`forward::is_withheld`) and Sluice adds none of its own; a
//! custom `real_ip_header` (`CF-Connecting-IP`, say) is forwarded like any other client header.

use std::net::{IpAddr, SocketAddr};

use crate::config::RealIp;
use crate::http::request::RequestHead;

/// The address Sluice treats as the client's for a request whose head is `head` (in `buf`),
/// received from `peer`.
pub(crate) fn client_address(
    peer: Option<SocketAddr>,
    head: &RequestHead,
    buf: &[u8],
    real_ip: &RealIp,
) -> Option<SocketAddr> {
    let tcp_peer = peer?;
    if real_ip.trusted.is_empty() || !trusted(real_ip, tcp_peer.ip()) {
        return peer;
    }
    let name = real_ip.header.as_bytes();
    let mut client = tcp_peer;
    for field in head.headers.iter().rev() {
        if !field.name(buf).eq_ignore_ascii_case(name) {
            continue;
        }
        for item in field.value(buf).rsplit(|&b| b == b',') {
            let Some(ip) = address(item) else {
                return Some(client);
            };
            client = SocketAddr::new(ip, 0);
            if !trusted(real_ip, ip) {
                return Some(client);
            }
        }
    }
    Some(client)
}

fn trusted(real_ip: &RealIp, ip: IpAddr) -> bool {
    real_ip.trusted.iter().any(|net| net.contains(ip))
}

/// One list item as an address: `192.0.2.1`, `2001:db8::1`, or either with a port
/// (`192.0.2.1:443`, `[2001:db8::1]:443`), spaces around it allowed.
fn address(item: &[u8]) -> Option<IpAddr> {
    let text = std::str::from_utf8(item).ok()?.trim_matches([' ', '\t']);
    text.parse::<IpAddr>()
        .ok()
        .or_else(|| text.parse::<SocketAddr>().ok().map(|a| a.ip()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::config::limits::Cidr;
    use crate::http::request::{parse_request_head, HeadScan};
    use crate::http::HttpLimits;

    fn real_ip(trusted: &[&str]) -> RealIp {
        RealIp {
            trusted: trusted.iter().map(|s| Cidr::parse(s).unwrap()).collect(),
            header: "x-forwarded-for".into(),
        }
    }

    fn client(peer: &str, fields: &str, trusted: &[&str]) -> String {
        let raw = format!("GET / HTTP/1.1\r\nHost: x\r\n{fields}\r\n");
        let mut head = RequestHead::default();
        let limits = HttpLimits {
            max_request_line_bytes: 1024,
            max_header_bytes: 4096,
            max_headers: 20,
            max_body_bytes: 0,
            max_translated_json_values: 100,
        };
        parse_request_head(raw.as_bytes(), &mut HeadScan::default(), &limits, &mut head).unwrap();
        let peer = Some(peer.parse().unwrap());
        client_address(peer, &head, raw.as_bytes(), &real_ip(trusted))
            .unwrap()
            .to_string()
    }

    #[test]
    fn the_peer_unless_it_is_trusted() {
        let xff = "X-Forwarded-For: 203.0.113.7\r\n";
        // Nobody trusted: the header is a claim, not read.
        assert_eq!(client("10.0.0.5:4000", xff, &[]), "10.0.0.5:4000");
        // A peer outside the trusted networks: the same.
        assert_eq!(
            client("192.0.2.9:4000", xff, &["10.0.0.0/8"]),
            "192.0.2.9:4000"
        );
        // A trusted peer: its word.
        assert_eq!(
            client("10.0.0.5:4000", xff, &["10.0.0.0/8"]),
            "203.0.113.7:0"
        );
        // A trusted peer that says nothing.
        assert_eq!(
            client("10.0.0.5:4000", "", &["10.0.0.0/8"]),
            "10.0.0.5:4000"
        );
    }

    #[test]
    fn read_right_to_left_past_trusted_hops_only() {
        let t = &["10.0.0.0/8", "2001:db8::/32"][..];
        // The client's own claim (leftmost) is never reached past an untrusted hop.
        let chain = "X-Forwarded-For: 1.1.1.1, 203.0.113.7, 10.0.0.2\r\n";
        assert_eq!(client("10.0.0.5:1", chain, t), "203.0.113.7:0");
        // Every hop trusted: the farthest.
        let all = "X-Forwarded-For: 10.1.1.1, 10.0.0.2\r\n";
        assert_eq!(client("10.0.0.5:1", all, t), "10.1.1.1:0");
        // Two fields: the last one is nearest.
        let two = "X-Forwarded-For: 198.51.100.1\r\nx-forwarded-for: 10.0.0.3, 10.0.0.2\r\n";
        assert_eq!(client("10.0.0.5:1", two, t), "198.51.100.1:0");
        // Ports and IPv6, with and without brackets.
        let ports = "X-Forwarded-For: [2001:db9::1]:443, 2001:db8::2, 10.0.0.2:80\r\n";
        assert_eq!(client("[2001:db8::9]:1", ports, t), "[2001:db9::1]:0");
        // Junk ends the reading at the last trusted hop.
        let junk = "X-Forwarded-For: 203.0.113.7, unknown, 10.0.0.2\r\n";
        assert_eq!(client("10.0.0.5:1", junk, t), "10.0.0.2:0");
        let empty = "X-Forwarded-For: 203.0.113.7,,\r\n";
        assert_eq!(client("10.0.0.5:1", empty, t), "10.0.0.5:1");
    }
}
