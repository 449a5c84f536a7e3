//! The two nf_tables netlink requests the packet hold needs: add and delete one element of a
//! set, each as one batch (begin, the element message with an ACK requested, end), answered
//! by the kernel's ACK or errno.
//!
//! Message layout (linux/netfilter/nfnetlink.h, nf_tables.h): `nlmsghdr`, `nfgenmsg`, then
//! netlink attributes (`nlattr` length/type, payload padded to 4 bytes). A set element's key
//! is the concatenation of its fields, each padded to a 4-byte register.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const NETLINK_NETFILTER: libc::c_int = 12;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;
const NFPROTO_INET: u8 = 1;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const NLMSG_ERROR: u16 = 2;
const NLA_F_NESTED: u16 = 0x8000;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_DATA_VALUE: u16 = 1;
/// How long an add or delete waits for the kernel's answer.
const ANSWER_TIMEOUT_SECS: libc::time_t = 5;

/// An nf_tables netlink socket, in the network namespace of the thread that opened it.
#[derive(Debug)]
pub struct NfTables {
    fd: OwnedFd,
    seq: u32,
}

/// The key of `saddr . sport . daddr . dport` in a set of that concatenated type.
pub fn tuple_key(src: &SocketAddr, dst: &SocketAddr) -> Vec<u8> {
    let mut k = Vec::with_capacity(40);
    for a in [src, dst] {
        match a.ip() {
            IpAddr::V4(ip) => k.extend_from_slice(&ip.octets()),
            IpAddr::V6(ip) => k.extend_from_slice(&ip.octets()),
        }
        k.extend_from_slice(&a.port().to_be_bytes());
        k.extend_from_slice(&[0, 0]);
    }
    k
}

fn attr(b: &mut Vec<u8>, ty: u16, payload: &[u8]) {
    b.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
    b.extend_from_slice(&ty.to_ne_bytes());
    b.extend_from_slice(payload);
    pad(b);
}

fn pad(b: &mut Vec<u8>) {
    while b.len() & 3 != 0 {
        b.push(0);
    }
}

/// A nested attribute: `inner` builds its content.
fn nested(b: &mut Vec<u8>, ty: u16, inner: impl FnOnce(&mut Vec<u8>)) {
    let start = b.len();
    b.extend_from_slice(&[0; 4]);
    inner(b);
    let len = (b.len() - start) as u16;
    b[start..start + 2].copy_from_slice(&len.to_ne_bytes());
    b[start + 2..start + 4].copy_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
}

fn cstr(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

/// One netlink message: header, nfgenmsg, attributes.
fn message(b: &mut Vec<u8>, ty: u16, flags: u16, seq: u32, family: u8, res_id: u16, attrs: &[u8]) {
    let len = 16 + 4 + attrs.len();
    b.extend_from_slice(&(len as u32).to_ne_bytes());
    b.extend_from_slice(&ty.to_ne_bytes());
    b.extend_from_slice(&flags.to_ne_bytes());
    b.extend_from_slice(&seq.to_ne_bytes());
    b.extend_from_slice(&0u32.to_ne_bytes());
    b.push(family);
    b.push(0); // NFNETLINK_V0
    b.extend_from_slice(&res_id.to_be_bytes());
    b.extend_from_slice(attrs);
}

impl NfTables {
    pub fn open() -> io::Result<NfTables> {
        // SAFETY: plain socket(2); the descriptor is owned at once.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                NETLINK_NETFILTER,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // An answer that never comes (a message dropped for want of buffer) must fail the move,
        // not hang it: the kernel answers in microseconds, or after a grace period at worst.
        let tv = libc::timeval {
            tv_sec: ANSWER_TIMEOUT_SECS,
            tv_usec: 0,
        };
        // SAFETY: `tv` is a live timeval of the size passed.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(NfTables { fd, seq: 1 })
    }

    /// Adds (`add`) or deletes the element `key` of `table`/`set` (family inet), and waits for
    /// the kernel's answer. Adding an element present, or deleting one absent, is an error.
    pub fn set_element(&mut self, table: &str, set: &str, key: &[u8], add: bool) -> io::Result<()> {
        self.set_elements(table, set, &[key.to_vec()], add)
    }

    /// [`NfTables::set_element`] for several keys in one message (one transaction: all or
    /// none).
    pub fn set_elements(
        &mut self,
        table: &str,
        set: &str,
        keys: &[Vec<u8>],
        add: bool,
    ) -> io::Result<()> {
        let mut attrs = Vec::with_capacity(128 + keys.len() * 64);
        attr(&mut attrs, NFTA_SET_ELEM_LIST_TABLE, &cstr(table));
        attr(&mut attrs, NFTA_SET_ELEM_LIST_SET, &cstr(set));
        nested(&mut attrs, NFTA_SET_ELEM_LIST_ELEMENTS, |b| {
            for key in keys {
                nested(b, NFTA_LIST_ELEM, |b| {
                    nested(b, NFTA_SET_ELEM_KEY, |b| attr(b, NFTA_DATA_VALUE, key));
                });
            }
        });
        let (ty, flags) = if add {
            (NFT_MSG_NEWSETELEM, NLM_F_CREATE | NLM_F_EXCL)
        } else {
            (NFT_MSG_DELSETELEM, 0)
        };
        let seq = self.seq;
        self.seq = self.seq.wrapping_add(3);
        let mut b = Vec::with_capacity(256);
        let sub = NFNL_SUBSYS_NFTABLES;
        message(
            &mut b,
            NFNL_MSG_BATCH_BEGIN,
            NLM_F_REQUEST,
            seq,
            0,
            sub,
            &[],
        );
        let elem_seq = seq.wrapping_add(1);
        let f = NLM_F_REQUEST | NLM_F_ACK | flags;
        message(&mut b, sub << 8 | ty, f, elem_seq, NFPROTO_INET, 0, &attrs);
        message(
            &mut b,
            NFNL_MSG_BATCH_END,
            NLM_F_REQUEST,
            seq.wrapping_add(2),
            0,
            sub,
            &[],
        );
        self.send(&b)?;
        self.wait_ack(elem_seq)
    }

    fn send(&self, b: &[u8]) -> io::Result<()> {
        // SAFETY: zeroed sockaddr_nl is valid; nl_family set below (pid 0: the kernel).
        let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: `b` and `sa` are live for the call, their sizes passed.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                b.as_ptr().cast(),
                b.len(),
                0,
                (&sa as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    fn wait_ack(&self, seq: u32) -> io::Result<()> {
        let mut buf = vec![0u8; 8192];
        loop {
            // SAFETY: `buf` is writable for its length.
            let n =
                unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            let mut m = &buf[..n as usize];
            while m.len() >= 16 {
                let len = u32::from_ne_bytes([m[0], m[1], m[2], m[3]]) as usize;
                let ty = u16::from_ne_bytes([m[4], m[5]]);
                let mseq = u32::from_ne_bytes([m[8], m[9], m[10], m[11]]);
                if len < 16 || len > m.len() {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "bad netlink message",
                    ));
                }
                // Only this request's answer counts: a late answer to an earlier one that timed
                // out is skipped.
                if ty == NLMSG_ERROR && len >= 20 && mseq == seq {
                    let errno = i32::from_ne_bytes([m[16], m[17], m[18], m[19]]);
                    if errno != 0 {
                        return Err(io::Error::from_raw_os_error(-errno));
                    }
                    return Ok(());
                }
                m = &m[((len + 3) & !3).min(m.len())..];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tuple_key_pads_each_field_to_a_register() {
        let k = tuple_key(
            &"10.0.0.1:258".parse().unwrap(),
            &"10.0.0.2:80".parse().unwrap(),
        );
        assert_eq!(k, [10, 0, 0, 1, 1, 2, 0, 0, 10, 0, 0, 2, 0, 80, 0, 0]);
        let k6 = tuple_key(&"[::1]:1".parse().unwrap(), &"[::2]:2".parse().unwrap());
        assert_eq!(k6.len(), 40);
    }
}
