//! A tc ingress filter that drops every frame: a two-instruction eBPF program (`r0 = TC_ACT_SHOT;
//! exit`) loaded with bpf(2) and attached as a direct-action `cls_bpf` filter over rtnetlink.
//!
//! Why not `tc filter ... matchall action drop`: on this kernel neither `cls_matchall`/`cls_u32`
//! nor the `gact` action module is available, while clsact + BPF direct-action works (checked on
//! this machine kind). Building the program and the netlink request by hand avoids a
//! clang step and an object file at run time; both are fixed and tiny.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
const TC_ACT_SHOT: i32 = 2;

/// Loads the drop program; returns its fd.
fn load_drop_prog() -> io::Result<OwnedFd> {
    // struct bpf_insn { u8 code; u8 dst:4 src:4; s16 off; s32 imm; }
    let mut insns = [0u8; 16];
    insns[0] = 0xb7; // BPF_ALU64 | BPF_MOV | BPF_K, dst r0
    insns[4..8].copy_from_slice(&TC_ACT_SHOT.to_ne_bytes());
    insns[8] = 0x95; // BPF_JMP | BPF_EXIT
    let license = b"GPL\0";
    let mut name = [0u8; 16];
    name[..11].copy_from_slice(b"pliant_drop");
    // union bpf_attr, BPF_PROG_LOAD layout (first 64 bytes; the rest stays zero).
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&BPF_PROG_TYPE_SCHED_CLS.to_ne_bytes());
    attr[4..8].copy_from_slice(&2u32.to_ne_bytes()); // insn_cnt
    attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    // log_level, log_size, log_buf, kern_version, prog_flags: zero.
    attr[48..64].copy_from_slice(&name);
    // SAFETY: attr points at a bpf_attr-sized buffer whose pointers (insns, license) outlive
    // the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_LOAD,
            attr.as_ptr(),
            attr.len() as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a fresh fd we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn push_attr(buf: &mut Vec<u8>, ty: u16, data: &[u8]) {
    let len = 4 + data.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&ty.to_ne_bytes());
    buf.extend_from_slice(data);
    while buf.len() & 3 != 0 {
        buf.push(0);
    }
}

/// Attaches the drop program on `ifindex`'s clsact ingress hook at preference `pref`.
/// The clsact qdisc must exist.
pub fn attach_ingress_drop(ifindex: i32, pref: u16) -> io::Result<()> {
    const RTM_NEWTFILTER: u16 = 44;
    const NLM_F_REQUEST: u16 = 0x1;
    const NLM_F_ACK: u16 = 0x4;
    const NLM_F_EXCL: u16 = 0x200;
    const NLM_F_CREATE: u16 = 0x400;
    const TCA_KIND: u16 = 1;
    const TCA_OPTIONS: u16 = 2;
    const NLA_F_NESTED: u16 = 0x8000;
    const TCA_BPF_FD: u16 = 6;
    const TCA_BPF_NAME: u16 = 7;
    const TCA_BPF_FLAGS: u16 = 8;
    const TCA_BPF_FLAG_ACT_DIRECT: u32 = 1;
    const PARENT_CLSACT_INGRESS: u32 = 0xFFFF_FFF2;
    const ETH_P_ALL_BE: u32 = 0x0300; // htons(ETH_P_ALL)

    let prog = load_drop_prog()?;
    let mut opts = Vec::new();
    push_attr(
        &mut opts,
        TCA_BPF_FD,
        &(prog.as_raw_fd() as u32).to_ne_bytes(),
    );
    push_attr(&mut opts, TCA_BPF_NAME, b"pliant_drop\0");
    push_attr(
        &mut opts,
        TCA_BPF_FLAGS,
        &TCA_BPF_FLAG_ACT_DIRECT.to_ne_bytes(),
    );

    let mut body = Vec::new();
    // struct tcmsg { u8 family, pad1; u16 pad2; i32 ifindex; u32 handle, parent, info; }
    body.extend_from_slice(&[0u8; 4]);
    body.extend_from_slice(&ifindex.to_ne_bytes());
    body.extend_from_slice(&0u32.to_ne_bytes());
    body.extend_from_slice(&PARENT_CLSACT_INGRESS.to_ne_bytes());
    body.extend_from_slice(&((u32::from(pref) << 16) | ETH_P_ALL_BE).to_ne_bytes());
    push_attr(&mut body, TCA_KIND, b"bpf\0");
    push_attr(&mut body, TCA_OPTIONS | NLA_F_NESTED, &opts);

    let mut msg = Vec::with_capacity(16 + body.len());
    msg.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
    msg.extend_from_slice(&RTM_NEWTFILTER.to_ne_bytes());
    msg.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL).to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes()); // seq
    msg.extend_from_slice(&0u32.to_ne_bytes()); // pid
    msg.extend_from_slice(&body);

    // SAFETY: plain socket creation.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh fd we own.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: zeroed sockaddr_nl addresses the kernel (pid 0).
    let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: msg and sa are valid for the given lengths.
    let sent = unsafe {
        libc::sendto(
            sock.as_raw_fd(),
            msg.as_ptr().cast(),
            msg.len(),
            0,
            (&sa as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut ack = [0u8; 4096];
    // SAFETY: ack is a writable buffer of its length.
    let n = unsafe { libc::recv(sock.as_raw_fd(), ack.as_mut_ptr().cast(), ack.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // struct nlmsgerr follows the 16-byte header: i32 error (0 = ACK).
    let n = n as usize;
    if n >= 20 && u16::from_ne_bytes([ack[4], ack[5]]) == libc::NLMSG_ERROR as u16 {
        let err = i32::from_ne_bytes([ack[16], ack[17], ack[18], ack[19]]);
        if err != 0 {
            return Err(io::Error::from_raw_os_error(-err));
        }
        return Ok(());
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidData,
        "unexpected rtnetlink answer",
    ))
}
