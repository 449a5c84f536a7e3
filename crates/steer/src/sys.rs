//! The three `bpf(2)` commands aya 0.14 does not wrap: batch update/delete (one syscall for many
//! exceptions) and BPF_PROG_TEST_RUN (key-equivalence tests and per-packet cost measurement).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

const BPF_PROG_TEST_RUN: libc::c_long = 10;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;

/// `union bpf_attr`, `batch` member.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// `union bpf_attr`, `test` member.
#[repr(C)]
#[derive(Default)]
struct TestAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    pad: u32,
}

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<()> {
    // SAFETY: attr is a live, correctly laid-out bpf_attr member of the given size; the
    // pointers inside it refer to buffers the caller keeps alive for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T as *mut libc::c_void,
            std::mem::size_of::<T>() as libc::c_uint,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Updates `count` entries in one syscall. `keys`/`values` are packed arrays of the map's key
/// and value size. Returns how many were processed before an error (all of them on success).
pub(crate) fn update_batch(
    map: BorrowedFd<'_>,
    keys: &[u8],
    values: &[u8],
    count: u32,
) -> (u32, io::Result<()>) {
    let mut a = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count,
        map_fd: map.as_raw_fd() as u32,
        ..Default::default()
    };
    let r = bpf(BPF_MAP_UPDATE_BATCH, &mut a);
    (a.count, r)
}

/// Deletes `count` keys in one syscall; like [`update_batch`] for the result. Deleting an absent
/// key fails with ENOENT at that position.
pub(crate) fn delete_batch(map: BorrowedFd<'_>, keys: &[u8], count: u32) -> (u32, io::Result<()>) {
    let mut a = BatchAttr {
        keys: keys.as_ptr() as u64,
        count,
        map_fd: map.as_raw_fd() as u32,
        ..Default::default()
    };
    let r = bpf(BPF_MAP_DELETE_BATCH, &mut a);
    (a.count, r)
}

/// `struct __sk_buff` size and the offset of `ingress_ifindex` in it (uapi, stable).
const SKB_CTX_SIZE: usize = 192;
const SKB_INGRESS_IFINDEX_OFF: usize = 36;

/// Result of one BPF_PROG_TEST_RUN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TestRun {
    /// The program's return value (TC_ACT_*).
    pub retval: u32,
    /// Mean run time per repetition, as the kernel measured it.
    pub duration_ns: u32,
}

pub(crate) fn test_run(
    prog: BorrowedFd<'_>,
    frame: &[u8],
    ingress_ifindex: u32,
    repeat: u32,
) -> io::Result<TestRun> {
    let mut ctx = [0u8; SKB_CTX_SIZE];
    ctx[SKB_INGRESS_IFINDEX_OFF..SKB_INGRESS_IFINDEX_OFF + 4]
        .copy_from_slice(&ingress_ifindex.to_ne_bytes());
    let len = u32::try_from(frame.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too long"))?;
    let mut a = TestAttr {
        prog_fd: prog.as_raw_fd() as u32,
        data_size_in: len,
        data_in: frame.as_ptr() as u64,
        repeat,
        ctx_size_in: SKB_CTX_SIZE as u32,
        ctx_in: ctx.as_ptr() as u64,
        ..Default::default()
    };
    bpf(BPF_PROG_TEST_RUN, &mut a)?;
    Ok(TestRun {
        retval: a.retval,
        duration_ns: a.duration,
    })
}
