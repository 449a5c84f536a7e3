//! The C ABI of Slices (`pliant_slice_*`): capture one established TCP connection of a C
//! server — its kernel state through TCP_REPAIR, the output the server had not written yet and
//! the server's own session bytes — as one versioned capsule, and restore it as a live socket,
//! in another process or after an upgrade, with no reset and no byte lost or repeated.
//!
//! The order a move follows (the same as `pliant_slice::migrate`, which Rust servers use):
//! 1. `pliant_slice_hold(h, fd)`: the client's segments of the connection are dropped from now
//!    until the release (there is a moment with no socket for the 4-tuple, when a segment
//!    would be answered with a RST, and a segment acknowledged after the capture would be lost);
//! 2. `pliant_slice_capture(fd, ...)`: the socket enters repair mode (it sends nothing by
//!    itself any more) and its state is read out into a capsule the caller sends wherever it
//!    is restored; on failure the socket leaves repair mode and the session goes on here;
//! 3. `pliant_slice_close_silent(fd)`: the old socket goes away without a FIN or a RST;
//! 4. `pliant_slice_restore(...)`: a new socket with the connection's state, in repair mode;
//! 5. `pliant_slice_release(h, fd)`, then `pliant_slice_resume(fd)`: the client's held
//!    segments come again (retransmitted), and the socket leaves repair mode and runs on.
//!
//! These calls need no context: errors are a `PLIANT_E*` code and the text of the calling
//! thread's last failure in `pliant_slice_last_error()`. No panic unwinds into C.

use crate::*;
use pliant_slice::hold::PacketHold;
use pliant_slice::{repair, RepairError, Slice};
use std::cell::RefCell;
use std::ffi::{CStr, CString};
use std::mem::ManuallyDrop;
use std::net::TcpStream;
use std::os::fd::{FromRawFd, IntoRawFd};
use std::os::raw::{c_char, c_int};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// A packet hold of the calling thread's network namespace (pliant-slice's queueing hold:
/// a tc-BPF filter on loopback and the other interfaces present at the open, and a veth pair;
/// or, when that cannot be set up, an nftables table dropping the held segments), from
/// `pliant_slice_hold_open` until `pliant_slice_hold_close`.
pub struct PliantSliceHold {
    hold: PacketHold,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn fail(code: c_int, msg: impl std::fmt::Display) -> c_int {
    let text = CString::new(msg.to_string().replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = text);
    code
}

fn guarded(f: impl FnOnce() -> c_int) -> c_int {
    catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|_| fail(PLIANT_EPANIC, "internal error (a bug in pliant)"))
}

fn repair_code(e: &RepairError) -> c_int {
    match e {
        RepairError::TupleInUse { .. } => PLIANT_EEXIST,
        RepairError::NotEstablished(_) | RepairError::MixedFamilies => PLIANT_EINVAL,
        RepairError::OtherNamespace { .. } => PLIANT_EINVAL,
        RepairError::Sys { .. } | RepairError::ShortPeek { .. } => PLIANT_EIO,
    }
}

/// The socket `fd` without taking it over (the caller keeps the descriptor).
fn borrowed(fd: c_int) -> Option<ManuallyDrop<TcpStream>> {
    // SAFETY: the stream is never dropped (ManuallyDrop), so `fd` stays the caller's; a
    // descriptor that is not a TCP socket makes the calls on it fail, not misbehave.
    (fd >= 0).then(|| ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd) }))
}

/// Copies `bytes` into a buffer for C, freed with `pliant_slice_free`.
fn give(bytes: Vec<u8>, out: *mut *mut u8, out_len: *mut usize) {
    let b = bytes.into_boxed_slice();
    let len = b.len();
    // SAFETY: callers checked both pointers for null.
    unsafe {
        *out_len = len;
        *out = Box::into_raw(b).cast::<u8>();
    }
}

fn input<'a>(p: *const u8, len: usize) -> Option<&'a [u8]> {
    match (p.is_null(), len) {
        (_, 0) => Some(&[]),
        (true, _) => None,
        // SAFETY: the caller passes `len` readable bytes at `p`.
        (false, _) => Some(unsafe { std::slice::from_raw_parts(p, len) }),
    }
}

/// Text of the calling thread's last failed `pliant_slice_*` call ("" if none). Valid until
/// that thread's next failing call.
#[no_mangle]
pub extern "C" fn pliant_slice_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Captures the established TCP connection `fd` with the server's unwritten output
/// (`pending`) and its session bytes (`app`) as a capsule under `session_id`, returned in a
/// new buffer (`*out`, `*out_len`; free it with `pliant_slice_free`). The socket is left in
/// repair mode: close it with `pliant_slice_close_silent` once the capsule is safe elsewhere,
/// or go on with it after `pliant_slice_resume`. On failure the socket has left repair mode.
/// The descriptor stays the caller's. Hold the connection's packets first.
/// # Safety
/// `pending`/`app` null or readable for their lengths; `out`, `out_len` writable.
#[no_mangle]
pub unsafe extern "C" fn pliant_slice_capture(
    fd: c_int,
    session_id: u64,
    pending: *const u8,
    pending_len: usize,
    app: *const u8,
    app_len: usize,
    out: *mut *mut u8,
    out_len: *mut usize,
) -> c_int {
    guarded(|| {
        let (Some(s), Some(pending), Some(app)) = (
            borrowed(fd),
            input(pending, pending_len),
            input(app, app_len),
        ) else {
            return fail(PLIANT_EINVAL, "capture: bad descriptor or null buffer");
        };
        if out.is_null() || out_len.is_null() {
            return fail(PLIANT_EINVAL, "capture: null output pointer");
        }
        let captured = repair::enter_repair(&s).and_then(|()| repair::capture(&s));
        let tcp = match captured {
            Ok(t) => t,
            Err(e) => {
                let _ = repair::leave_repair(&s);
                return fail(
                    repair_code(&e),
                    format!("capture (session left running): {e}"),
                );
            }
        };
        let slice = Slice {
            session_id,
            tcp,
            pending_out: pending.to_vec(),
            app: app.to_vec(),
        };
        give(pliant_slice::encode(&slice), out, out_len);
        PLIANT_OK
    })
}

/// Frees a buffer a `pliant_slice_*` call returned (null is ignored).
/// # Safety
/// `buf` null or a buffer a `pliant_slice_*` call returned with this `len`, freed once.
#[no_mangle]
pub unsafe extern "C" fn pliant_slice_free(buf: *mut u8, len: usize) {
    if buf.is_null() {
        return;
    }
    // SAFETY: `buf` and `len` come from `give` (a boxed slice of exactly `len` bytes).
    drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(buf, len)) });
}

/// Closes `fd` (a socket in repair mode after `pliant_slice_capture`) without sending anything:
/// the connection lives on in its restored copy. Takes the descriptor over, also on failure.
#[no_mangle]
pub extern "C" fn pliant_slice_close_silent(fd: c_int) -> c_int {
    guarded(|| {
        if fd < 0 {
            return fail(PLIANT_EINVAL, "close_silent: bad descriptor");
        }
        // SAFETY: the caller hands the descriptor over.
        let s = unsafe { TcpStream::from_raw_fd(fd) };
        match repair::close_in_repair(s) {
            Ok(()) => PLIANT_OK,
            Err(e) => fail(repair_code(&e), format!("close_silent: {e}")),
        }
    })
}

/// Ends repair mode on `fd` (a restored socket, or a captured one whose move was given up):
/// the socket sends and receives again.
#[no_mangle]
pub extern "C" fn pliant_slice_resume(fd: c_int) -> c_int {
    guarded(|| {
        let Some(s) = borrowed(fd) else {
            return fail(PLIANT_EINVAL, "resume: bad descriptor");
        };
        match repair::leave_repair(&s) {
            Ok(()) => PLIANT_OK,
            Err(e) => fail(repair_code(&e), format!("resume: {e}")),
        }
    })
}

/// Restores the capsule `buf` as a new socket (`*fd_out`, in repair mode: release its hold,
/// then `pliant_slice_resume`), and returns the session id, the server's unwritten output and
/// its session bytes (buffers to free with `pliant_slice_free`). A capsule of another format
/// version, damaged or truncated is `PLIANT_EDECODE`; a 4-tuple still held by another socket
/// `PLIANT_EEXIST`; a capsule of another network namespace `PLIANT_EINVAL`. Nothing is
/// returned on failure.
/// # Safety
/// `buf` readable for `len` bytes; every output pointer writable.
#[no_mangle]
pub unsafe extern "C" fn pliant_slice_restore(
    buf: *const u8,
    len: usize,
    fd_out: *mut c_int,
    session_id: *mut u64,
    pending: *mut *mut u8,
    pending_len: *mut usize,
    app: *mut *mut u8,
    app_len: *mut usize,
) -> c_int {
    guarded(|| {
        let Some(bytes) = input(buf, len) else {
            return fail(PLIANT_EINVAL, "restore: null capsule");
        };
        if fd_out.is_null()
            || session_id.is_null()
            || pending.is_null()
            || pending_len.is_null()
            || app.is_null()
            || app_len.is_null()
        {
            return fail(PLIANT_EINVAL, "restore: null output pointer");
        }
        let slice = match pliant_slice::decode(bytes) {
            Ok(s) => s,
            Err(e) => return fail(PLIANT_EDECODE, format!("restore: {e}")),
        };
        let sock = match repair::restore(&slice.tcp) {
            Ok(s) => s,
            Err(e) => return fail(repair_code(&e), format!("restore: {e}")),
        };
        // SAFETY: all pointers were checked for null above.
        unsafe {
            *fd_out = sock.into_raw_fd();
            *session_id = slice.session_id;
        }
        give(slice.pending_out, pending, pending_len);
        give(slice.app, app, app_len);
        PLIANT_OK
    })
}

/// Opens a packet hold in the calling thread's network namespace (`tag`, may be null, names
/// the nftables table of the dropping fallback). Null on failure (see
/// `pliant_slice_last_error`).
/// # Safety
/// `tag` null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn pliant_slice_hold_open(tag: *const c_char) -> *mut PliantSliceHold {
    let r = catch_unwind(|| {
        let tag = if tag.is_null() {
            "c".to_string()
        } else {
            // SAFETY: a non-null tag is a NUL-terminated string.
            unsafe { CStr::from_ptr(tag) }
                .to_string_lossy()
                .into_owned()
        };
        match PacketHold::create(&tag) {
            Ok(hold) => Box::into_raw(Box::new(PliantSliceHold { hold })),
            Err(e) => {
                fail(PLIANT_EIO, format!("hold_open: {e}"));
                std::ptr::null_mut()
            }
        }
    });
    r.unwrap_or_else(|_| {
        fail(PLIANT_EPANIC, "internal error (a bug in pliant)");
        std::ptr::null_mut()
    })
}

/// Removes the hold (every connection it still held is let through; segments it kept are
/// not written back).
/// # Safety
/// `h` null or an open hold, closed once.
#[no_mangle]
pub unsafe extern "C" fn pliant_slice_hold_close(h: *mut PliantSliceHold) {
    if !h.is_null() {
        // SAFETY: `h` comes from `pliant_slice_hold_open` and is closed once.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(h) })));
    }
}

fn change_hold(h: *mut PliantSliceHold, fd: c_int, add: bool) -> c_int {
    guarded(|| {
        // SAFETY: `h` is null or an open hold.
        let (Some(h), Some(s)) = (unsafe { h.as_ref() }, borrowed(fd)) else {
            return fail(PLIANT_EINVAL, "hold: null table or bad descriptor");
        };
        let (local, remote) = match (s.local_addr(), s.peer_addr()) {
            (Ok(l), Ok(r)) => (l, r),
            (Err(e), _) | (_, Err(e)) => {
                return fail(PLIANT_EINVAL, format!("hold: not a connected socket: {e}"))
            }
        };
        let r = if add {
            h.hold.hold(&local, &remote)
        } else {
            h.hold.release(&local, &remote)
        };
        match r {
            Ok(()) => PLIANT_OK,
            Err(e) => fail(PLIANT_EIO, format!("hold {local} <-> {remote}: {e}")),
        }
    })
}

/// Keeps the client's segments of `fd`'s connection from the stack from now on (before the
/// capture): queued, or dropped by the fallback.
/// # Safety
/// `h` null or an open hold.
#[no_mangle]
pub unsafe extern "C" fn pliant_slice_hold(h: *mut PliantSliceHold, fd: c_int) -> c_int {
    change_hold(h, fd, true)
}

/// Lets the client's segments of `fd`'s connection through again, the queued ones first, in
/// order (`fd` may be the restored socket: it has the same addresses; it must exist by then).
/// # Safety
/// `h` null or an open hold.
#[no_mangle]
pub unsafe extern "C" fn pliant_slice_release(h: *mut PliantSliceHold, fd: c_int) -> c_int {
    change_hold(h, fd, false)
}
