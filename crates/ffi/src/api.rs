//! The `extern "C"` functions of `pliant.h`. Each one validates its pointers, runs under
//! `catch_unwind`, and turns errors into `PLIANT_E*` codes (text in `pliant_last_error`).
//!
//! Pointer rules for C callers (also in the header's comments):
//! - a `PliantCtx*` is valid from `pliant_open*` until `pliant_close`; one thread at a time;
//! - a `PliantPkt*` from `pliant_pkt_read` is held until `pliant_pkt_write`,
//!   `pliant_pkt_write_direct` or `pliant_pkt_drop`; using it afterwards is detected (an empty
//!   slot) until its slot is reused by a later read;
//! - the state pointer of `pliant_get_flow` is valid until the matching `pliant_put_flow`; the
//!   pointers of `pliant_get_shared` until the matching `pliant_put_shared`.

use crate::ctx::{side_code, side_of, Error, PliantCtx, PliantPkt, Res, MEM_MAC_INSIDE};
use crate::*;
use pliant_net::Frame;
use pliant_state::FlowKey;
use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr};
use std::os::raw::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

/// Bound on rounds in one `pliant_mem_advance`, so timers that re-arm themselves at the same
/// instant fail the call instead of hanging it.
const MAX_ADVANCE_ROUNDS: usize = 1_000_000;

/// A static NUL-terminated string as a C pointer (C-string literals are newer than the
/// header generator's parser).
macro_rules! cs {
    ($s:literal) => {
        concat!($s, "\0").as_ptr() as *const c_char
    };
}

// ---- helpers -------------------------------------------------------------------------------

/// Runs `f` on a validated context: null/closed pointers are EINVAL, a poisoned context
/// EPANIC, a panic poisons the context.
fn call(ctx: *mut PliantCtx, f: impl FnOnce(&mut PliantCtx) -> Res<c_int>) -> c_int {
    // SAFETY: the header documents that ctx is null or an open context.
    let Some(c) = (unsafe { PliantCtx::from_ptr(ctx) }) else {
        return PLIANT_EINVAL;
    };
    if c.poisoned {
        return PLIANT_EPANIC;
    }
    let r = {
        let cr = &mut *c;
        catch_unwind(AssertUnwindSafe(move || f(cr)))
    };
    finish(c, r)
}

fn finish(c: &mut PliantCtx, r: std::thread::Result<Res<c_int>>) -> c_int {
    match r {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            c.set_error(&e);
            e.code
        }
        Err(_) => {
            c.poisoned = true;
            c.in_callback = false;
            c.set_error(&Error::new(
                PLIANT_EPANIC,
                "internal error (a panic in pliant); the context refuses further calls",
            ));
            PLIANT_EPANIC
        }
    }
}

/// Like [`call`] for the calls that run engine rounds and timer callbacks: `f` gets the raw
/// pointer and must only borrow the context in short scopes, never across a callback.
fn call_raw(
    ctx: *mut PliantCtx,
    what: &str,
    f: impl FnOnce(*mut PliantCtx) -> Res<c_int>,
) -> c_int {
    // SAFETY: as in `call`.
    let Some(c) = (unsafe { PliantCtx::from_ptr(ctx) }) else {
        return PLIANT_EINVAL;
    };
    if c.poisoned {
        return PLIANT_EPANIC;
    }
    if c.in_callback {
        c.set_error(&Error::new(
            PLIANT_EBUSY,
            format!("{what} called from inside a timer callback"),
        ));
        return PLIANT_EBUSY;
    }
    let r = catch_unwind(AssertUnwindSafe(|| f(ctx)));
    // SAFETY: ctx was validated above and `f` ended all its borrows.
    let c = unsafe { &mut *ctx };
    finish(c, r)
}

/// A panic-free value for calls without a context.
fn guard<T>(default: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(default)
}

/// # Safety
/// `p` null or a NUL-terminated string.
unsafe fn cstr<'a>(p: *const c_char, what: &str) -> Res<&'a str> {
    if p.is_null() {
        return Err(Error::inval(format!("{what} is null")));
    }
    CStr::from_ptr(p)
        .to_str()
        .map_err(|_| Error::inval(format!("{what} is not UTF-8")))
}

/// # Safety
/// `p` null or pointing to a PliantFlowKey.
unsafe fn key_in(p: *const PliantFlowKey) -> Res<FlowKey> {
    p.as_ref()
        .map(|k| FlowKey::from(*k))
        .ok_or_else(|| Error::inval("flow key is null"))
}

fn label(p: *const c_char, what: &str) -> Res<&'static str> {
    // SAFETY: documented: a NUL-terminated string.
    let s = unsafe { cstr(p, what)? };
    if !labels::valid(s) {
        return Err(Error::inval(format!(
            "{what} {s:?}: use 1..={} of [a-z0-9_]",
            labels::MAX_LABEL_LEN
        )));
    }
    Ok(labels::intern(s))
}

/// # Safety
/// `out` null or writable.
unsafe fn put_out<T>(out: *mut T, v: T) {
    if let Some(o) = out.as_mut() {
        *o = v;
    }
}

/// Copies `s` plus a NUL into `buf` if it fits; returns the length without the NUL
/// (snprintf-style: a return >= cap means it was cut).
///
/// # Safety
/// `buf` null or writable for `cap` bytes.
unsafe fn write_cstr(s: &str, buf: *mut c_char, cap: usize) -> usize {
    if !buf.is_null() && cap > 0 {
        let n = s.len().min(cap - 1);
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf as *mut u8, n);
        *buf.add(n) = 0;
    }
    s.len()
}

// ---- lifetime --------------------------------------------------------------------------------

fn open_result(
    r: std::thread::Result<Res<Box<PliantCtx>>>,
    err: *mut c_char,
    cap: usize,
) -> *mut PliantCtx {
    let msg = match r {
        Ok(Ok(c)) => return Box::into_raw(c),
        Ok(Err(e)) => e.msg,
        Err(_) => "internal error (a panic in pliant) while opening".to_string(),
    };
    // SAFETY: documented: err null or writable for err_cap bytes.
    unsafe { write_cstr(&msg, err, cap) };
    std::ptr::null_mut()
}

/// Opens a replica on real interfaces as configured by the replica TOML at `config_path`
/// (`nf.kind = "c"`; NF settings in an optional `[c]` table, see `pliant_config_int`).
/// Installs SIGTERM/SIGINT handlers that make `pliant_pkt_read` return `PLIANT_ESTOPPED`.
/// Returns NULL on failure with the reason in `err` (NUL-terminated, cut to `err_cap`).
///
/// # Safety
/// `config_path` a NUL-terminated string; `err` null or writable for `err_cap` bytes.
#[no_mangle]
pub unsafe extern "C" fn pliant_open(
    config_path: *const c_char,
    err: *mut c_char,
    err_cap: usize,
) -> *mut PliantCtx {
    let r = catch_unwind(AssertUnwindSafe(|| {
        let path = cstr(config_path, "config_path")?;
        PliantCtx::open_live(path)
    }));
    open_result(r, err, err_cap)
}

/// Opens a context with in-memory ports and a fake clock (tests): inject frames with
/// `pliant_mem_inject`, collect sent ones with `pliant_mem_take`, move time with
/// `pliant_mem_advance`. `config_path` may be NULL: inside 10.0.1.1/24, outside 10.0.2.1/24.
///
/// # Safety
/// `config_path` null or a NUL-terminated string; `err` null or writable for `err_cap` bytes.
#[no_mangle]
pub unsafe extern "C" fn pliant_open_mem(
    config_path: *const c_char,
    err: *mut c_char,
    err_cap: usize,
) -> *mut PliantCtx {
    let r = catch_unwind(AssertUnwindSafe(|| {
        let path = if config_path.is_null() {
            None
        } else {
            Some(cstr(config_path, "config_path")?)
        };
        PliantCtx::open_mem(path, None)
    }));
    open_result(r, err, err_cap)
}

/// Opens a second in-memory replica of the same group as `peer` (same addresses and `[c]`
/// settings, one coherence hub: PUSH/PULL of shared state between them), e.g. to migrate
/// flows between two instances in a test.
///
/// # Safety
/// `peer` an open in-memory context; `err` null or writable for `err_cap` bytes.
#[no_mangle]
pub unsafe extern "C" fn pliant_open_mem_peer(
    peer: *const PliantCtx,
    err: *mut c_char,
    err_cap: usize,
) -> *mut PliantCtx {
    let r = catch_unwind(AssertUnwindSafe(|| {
        let p = PliantCtx::from_ptr(peer as *mut PliantCtx)
            .ok_or_else(|| Error::inval("peer is not an open context"))?;
        PliantCtx::open_mem(None, Some(p))
    }));
    open_result(r, err, err_cap)
}

/// Sends what the program wrote, releases everything (ports, control socket, kernel guards).
/// Returns PLIANT_EBUSY (and closes nothing) from inside a timer callback.
///
/// # Safety
/// `ctx` null or an open context, not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn pliant_close(ctx: *mut PliantCtx) -> c_int {
    let Some(c) = PliantCtx::from_ptr(ctx) else {
        return PLIANT_EINVAL;
    };
    if c.in_callback {
        c.set_error(&Error::new(
            PLIANT_EBUSY,
            "pliant_close called from a timer callback",
        ));
        return PLIANT_EBUSY;
    }
    let poisoned = c.poisoned;
    c.invalidate();
    let r = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: ctx came from Box::into_raw in an open function and is closed only here.
        let mut b = Box::from_raw(ctx);
        if !poisoned {
            // Last round: route output written since the previous round.
            b.round();
        }
        drop(b);
    }));
    if r.is_err() {
        PLIANT_EPANIC
    } else {
        PLIANT_OK
    }
}

/// Asks `pliant_pkt_read` to return PLIANT_ESTOPPED (e.g. from the program's own signal
/// handling; not async-signal-safe itself: call it from the main loop).
///
/// # Safety
/// `ctx` null or an open context.
#[no_mangle]
pub unsafe extern "C" fn pliant_stop(ctx: *mut PliantCtx) -> c_int {
    call(ctx, |c| {
        c.request_stop();
        Ok(PLIANT_OK)
    })
}

/// Text of the last failed call on `ctx` (valid until the next call). Never NULL.
///
/// # Safety
/// `ctx` null or an open context.
#[no_mangle]
pub unsafe extern "C" fn pliant_last_error(ctx: *const PliantCtx) -> *const c_char {
    match PliantCtx::from_ptr(ctx as *mut PliantCtx) {
        Some(c) => c.last_error.as_ptr(),
        None => cs!("invalid context (null or closed)"),
    }
}

/// Name of an error code, e.g. "PLIANT_EMIGRATED". Never NULL.
#[no_mangle]
pub extern "C" fn pliant_strerror(code: c_int) -> *const c_char {
    match code {
        PLIANT_OK => cs!("PLIANT_OK"),
        PLIANT_ENOTFOUND => cs!("PLIANT_ENOTFOUND"),
        PLIANT_EMIGRATED => cs!("PLIANT_EMIGRATED"),
        PLIANT_EEXIST => cs!("PLIANT_EEXIST"),
        PLIANT_EBUSY => cs!("PLIANT_EBUSY"),
        PLIANT_EFULL => cs!("PLIANT_EFULL"),
        PLIANT_EINVAL => cs!("PLIANT_EINVAL"),
        PLIANT_ENOSPC => cs!("PLIANT_ENOSPC"),
        PLIANT_ETIMEDOUT => cs!("PLIANT_ETIMEDOUT"),
        PLIANT_ESTOPPED => cs!("PLIANT_ESTOPPED"),
        PLIANT_EDECODE => cs!("PLIANT_EDECODE"),
        PLIANT_EMODE => cs!("PLIANT_EMODE"),
        PLIANT_ELOCKED => cs!("PLIANT_ELOCKED"),
        PLIANT_EIO => cs!("PLIANT_EIO"),
        PLIANT_ENOTOPEN => cs!("PLIANT_ENOTOPEN"),
        PLIANT_EPANIC => cs!("PLIANT_EPANIC"),
        _ => cs!("unknown pliant error code"),
    }
}

/// Integer setting `name` of the config's `[c]` table. PLIANT_ENOTFOUND when absent.
///
/// # Safety
/// `ctx` an open context; `name` a NUL-terminated string; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn pliant_config_int(
    ctx: *mut PliantCtx,
    name: *const c_char,
    out: *mut i64,
) -> c_int {
    call(ctx, |c| {
        let name = cstr(name, "name")?;
        if out.is_null() {
            return Err(Error::inval("out is null"));
        }
        *out = c.config_int(name)?;
        Ok(PLIANT_OK)
    })
}

// ---- packets -----------------------------------------------------------------------------------

/// Hands out expired timers to the C callback, outside any borrow of the context.
///
/// # Safety
/// `p` a validated open context.
unsafe fn dispatch_timers(p: *mut PliantCtx) {
    let (timers, cb, user) = {
        let c = &mut *p;
        (c.take_timers(), c.timer_cb, c.timer_user)
    };
    if !timers.is_empty() {
        match cb {
            None => {
                let c = &mut *p;
                c.stats.timers_without_handler += timers.len() as u64;
                c.count("c_timers_without_handler", timers.len() as u64);
            }
            Some(f) => {
                (*p).in_callback = true;
                for (k, id) in &timers {
                    let key = PliantFlowKey::from(*k);
                    f(p, &key, *id, user);
                    (*p).stats.timers_dispatched += 1;
                }
                (*p).in_callback = false;
            }
        }
    }
    (*p).timer_scratch = timers;
}

/// Waits up to `timeout_ms` (negative: until stopped) for the next packet, running engine
/// rounds (I/O, ARP, parsing, routing what was written, timers) meanwhile; expired flow timers
/// are delivered to the `pliant_on_timer` callback from inside this call. On PLIANT_OK `*out`
/// holds a packet the caller must pass to exactly one of `pliant_pkt_write`,
/// `pliant_pkt_write_direct`, `pliant_pkt_drop`. Other returns: PLIANT_ETIMEDOUT,
/// PLIANT_ESTOPPED, PLIANT_EFULL (the caller holds too many packets). In-memory contexts never
/// wait: without a queued packet they return PLIANT_ETIMEDOUT after one round.
///
/// # Safety
/// `ctx` an open context; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_read(
    ctx: *mut PliantCtx,
    timeout_ms: i32,
    out: *mut *mut PliantPkt,
) -> c_int {
    call_raw(ctx, "pliant_pkt_read", |p| {
        if out.is_null() {
            return Err(Error::inval("out is null"));
        }
        *out = std::ptr::null_mut();
        let start = Instant::now();
        let limit = u64::try_from(timeout_ms).ok().map(Duration::from_millis);
        let stopped = || Error::new(PLIANT_ESTOPPED, "the replica was asked to stop");
        loop {
            {
                let c = &mut *p;
                if c.stopped() {
                    return Err(stopped());
                }
                if let Some(pkt) = c.next_packet()? {
                    *out = pkt;
                    return Ok(PLIANT_OK);
                }
                c.round();
            }
            dispatch_timers(p);
            let c = &mut *p;
            if let Some(pkt) = c.next_packet()? {
                *out = pkt;
                return Ok(PLIANT_OK);
            }
            if c.stopped() {
                return Err(stopped());
            }
            let timed_out = || Error::new(PLIANT_ETIMEDOUT, "no packet within the timeout");
            if c.is_mem() {
                return Err(timed_out());
            }
            let left = match limit {
                None => Duration::from_secs(1),
                Some(l) => match l.checked_sub(start.elapsed()) {
                    Some(left) if !left.is_zero() => left,
                    _ => return Err(timed_out()),
                },
            };
            c.wait(left);
        }
    })
}

/// Runs one engine round without reading a packet: sends what was written, fires due timers.
///
/// # Safety
/// `ctx` an open context.
#[no_mangle]
pub unsafe extern "C" fn pliant_flush(ctx: *mut PliantCtx) -> c_int {
    call_raw(ctx, "pliant_flush", |p| {
        (*p).round();
        dispatch_timers(p);
        Ok(PLIANT_OK)
    })
}

/// Output that depends on the state of flow `key` (Pico replication holds it until the
/// flow's checkpoint is acknowledged). Ends the caller's hold on `pkt`.
///
/// # Safety
/// `ctx` an open context; `key` readable; `pkt` from this context's `pliant_pkt_read`.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_write(
    ctx: *mut PliantCtx,
    key: *const PliantFlowKey,
    pkt: *mut PliantPkt,
) -> c_int {
    call(ctx, |c| {
        let k = key_in(key)?;
        c.pkt_write(Some(k), pkt)?;
        Ok(PLIANT_OK)
    })
}

/// Output exempt from output buffering by design. Ends the caller's hold on `pkt`.
///
/// # Safety
/// `ctx` an open context; `pkt` from this context's `pliant_pkt_read`.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_write_direct(
    ctx: *mut PliantCtx,
    pkt: *mut PliantPkt,
) -> c_int {
    call(ctx, |c| {
        c.pkt_write(None, pkt)?;
        Ok(PLIANT_OK)
    })
}

/// Drops `pkt`, counted under `reason` (`[a-z0-9_]`, at most 64 bytes; NULL: "c_drop").
///
/// # Safety
/// `ctx` an open context; `pkt` from this context's `pliant_pkt_read`; `reason` null or a
/// NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_drop(
    ctx: *mut PliantCtx,
    pkt: *mut PliantPkt,
    reason: *const c_char,
) -> c_int {
    call(ctx, |c| {
        let reason = if reason.is_null() {
            "c_drop"
        } else {
            label(reason, "reason")?
        };
        c.pkt_drop(pkt, reason)?;
        Ok(PLIANT_OK)
    })
}

/// The frame's bytes (Ethernet header first). NULL if `pkt` is not a held packet.
///
/// # Safety
/// `pkt` null or from `pliant_pkt_read` of an open context.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_data(pkt: *const PliantPkt) -> *const u8 {
    guard(std::ptr::null(), || {
        PliantPkt::get(pkt).map_or(std::ptr::null(), |p| p.buf.as_ptr())
    })
}

/// Frame length in bytes (0 if `pkt` is not a held packet).
///
/// # Safety
/// As `pliant_pkt_data`.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_len(pkt: *const PliantPkt) -> usize {
    guard(0, || PliantPkt::get(pkt).map_or(0, |p| p.buf.len()))
}

/// L4 payload (after the TCP/UDP/ICMP header, without Ethernet padding) and its length.
///
/// # Safety
/// As `pliant_pkt_data`; `len` null or writable.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_payload(pkt: *const PliantPkt, len: *mut usize) -> *const u8 {
    guard(std::ptr::null(), || match PliantPkt::get(pkt) {
        Some(p) => {
            let pl = p.payload();
            put_out(len, pl.len());
            pl.as_ptr()
        }
        None => {
            put_out(len, 0);
            std::ptr::null()
        }
    })
}

/// The packet's direction-normalised flow key (all zero if `pkt` is not a held packet).
///
/// # Safety
/// As `pliant_pkt_data`.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_key(pkt: *const PliantPkt) -> PliantFlowKey {
    guard(PliantFlowKey::default(), || {
        PliantPkt::get(pkt).map_or(PliantFlowKey::default(), |p| p.key().into())
    })
}

/// PLIANT_DIR_LO_TO_HI or PLIANT_DIR_HI_TO_LO relative to the key; PLIANT_EINVAL.
///
/// # Safety
/// As `pliant_pkt_data`.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_dir(pkt: *const PliantPkt) -> c_int {
    guard(PLIANT_EINVAL, || {
        match PliantPkt::get(pkt).map(|p| p.meta.dir) {
            Some(pliant_state::Dir::LoToHi) => PLIANT_DIR_LO_TO_HI,
            Some(pliant_state::Dir::HiToLo) => PLIANT_DIR_HI_TO_LO,
            None => PLIANT_EINVAL,
        }
    })
}

/// PLIANT_SIDE_INSIDE or PLIANT_SIDE_OUTSIDE: the port the packet arrived on; PLIANT_EINVAL.
///
/// # Safety
/// As `pliant_pkt_data`.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_ingress(pkt: *const PliantPkt) -> c_int {
    guard(PLIANT_EINVAL, || {
        PliantPkt::get(pkt).map_or(PLIANT_EINVAL, |p| side_code(p.ingress))
    })
}

/// Sets the port the packet leaves by (default: the opposite of its ingress).
///
/// # Safety
/// As `pliant_pkt_data`.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_set_egress(pkt: *mut PliantPkt, side: c_int) -> c_int {
    guard(PLIANT_EINVAL, || {
        let (Some(p), Ok(s)) = (PliantPkt::get_mut(pkt), side_of(side)) else {
            return PLIANT_EINVAL;
        };
        p.egress = s;
        PLIANT_OK
    })
}

/// IP protocol number (0 if `pkt` is not a held packet).
///
/// # Safety
/// As `pliant_pkt_data`.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_proto(pkt: *const PliantPkt) -> u8 {
    guard(0, || PliantPkt::get(pkt).map_or(0, |p| p.meta.proto))
}

/// TCP flags byte (0 for other protocols).
///
/// # Safety
/// As `pliant_pkt_data`.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_tcp_flags(pkt: *const PliantPkt) -> u8 {
    guard(0, || PliantPkt::get(pkt).map_or(0, |p| p.meta.tcp_flags))
}

/// Source port (ICMP echo: identifier), host byte order.
///
/// # Safety
/// As `pliant_pkt_data`.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_sport(pkt: *const PliantPkt) -> u16 {
    guard(0, || PliantPkt::get(pkt).map_or(0, |p| p.meta.sport))
}

/// Destination port (ICMP echo: identifier), host byte order.
///
/// # Safety
/// As `pliant_pkt_data`.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_dport(pkt: *const PliantPkt) -> u16 {
    guard(0, || PliantPkt::get(pkt).map_or(0, |p| p.meta.dport))
}

/// IPv4 source address in host byte order (0 for IPv6 or a bad `pkt`).
///
/// # Safety
/// As `pliant_pkt_data`.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_src_ipv4(pkt: *const PliantPkt) -> u32 {
    guard(0, || match PliantPkt::get(pkt).map(|p| p.meta.src) {
        Some(IpAddr::V4(a)) => u32::from(a),
        _ => 0,
    })
}

/// IPv4 destination address in host byte order (0 for IPv6 or a bad `pkt`).
///
/// # Safety
/// As `pliant_pkt_data`.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_dst_ipv4(pkt: *const PliantPkt) -> u32 {
    guard(0, || match PliantPkt::get(pkt).map(|p| p.meta.dst) {
        Some(IpAddr::V4(a)) => u32::from(a),
        _ => 0,
    })
}

/// Which header field a rewrite helper changes.
enum Field {
    SrcIp(u32),
    DstIp(u32),
    SrcPort(u16),
    DstPort(u16),
}

unsafe fn rewrite(pkt: *mut PliantPkt, f: Field) -> c_int {
    guard(PLIANT_EINVAL, || {
        let Some(p) = PliantPkt::get_mut(pkt) else {
            return PLIANT_EINVAL;
        };
        use pliant_net::rewrite as rw;
        let r = match f {
            Field::SrcIp(a) => rw::set_src_ip(&mut p.buf, &mut p.meta, Ipv4Addr::from(a).into()),
            Field::DstIp(a) => rw::set_dst_ip(&mut p.buf, &mut p.meta, Ipv4Addr::from(a).into()),
            Field::SrcPort(n) => rw::set_src_port(&mut p.buf, &mut p.meta, n),
            Field::DstPort(n) => rw::set_dst_port(&mut p.buf, &mut p.meta, n),
        };
        if r.is_ok() {
            PLIANT_OK
        } else {
            PLIANT_EINVAL
        }
    })
}

/// Rewrites the IPv4 source address (host byte order), checksums updated incrementally;
/// the packet's key follows. PLIANT_EINVAL for IPv6 packets or a bad `pkt`.
///
/// # Safety
/// As `pliant_pkt_data`.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_set_src_ipv4(pkt: *mut PliantPkt, addr: u32) -> c_int {
    rewrite(pkt, Field::SrcIp(addr))
}

/// Rewrites the IPv4 destination address (host byte order). See `pliant_pkt_set_src_ipv4`.
///
/// # Safety
/// As `pliant_pkt_data`.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_set_dst_ipv4(pkt: *mut PliantPkt, addr: u32) -> c_int {
    rewrite(pkt, Field::DstIp(addr))
}

/// Rewrites the TCP/UDP source port. PLIANT_EINVAL for protocols without ports.
///
/// # Safety
/// As `pliant_pkt_data`.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_set_src_port(pkt: *mut PliantPkt, port: u16) -> c_int {
    rewrite(pkt, Field::SrcPort(port))
}

/// Rewrites the TCP/UDP destination port. PLIANT_EINVAL for protocols without ports.
///
/// # Safety
/// As `pliant_pkt_data`.
#[no_mangle]
pub unsafe extern "C" fn pliant_pkt_set_dst_port(pkt: *mut PliantPkt, port: u16) -> c_int {
    rewrite(pkt, Field::DstPort(port))
}

// ---- flows -------------------------------------------------------------------------------------

/// Allocates `size` zero bytes of state for flow `key`. PLIANT_EEXIST, PLIANT_EFULL,
/// PLIANT_EMIGRATED (the key was exported from here), PLIANT_EINVAL (size over 64 KiB).
///
/// # Safety
/// `ctx` an open context; `key` readable.
#[no_mangle]
pub unsafe extern "C" fn pliant_create_flow(
    ctx: *mut PliantCtx,
    key: *const PliantFlowKey,
    size: usize,
) -> c_int {
    call(ctx, |c| {
        c.create_flow(key_in(key)?, size)?;
        Ok(PLIANT_OK)
    })
}

/// Frees flow `key` and its timers. PLIANT_EBUSY while a get_flow is open on it.
///
/// # Safety
/// `ctx` an open context; `key` readable.
#[no_mangle]
pub unsafe extern "C" fn pliant_delete_flow(
    ctx: *mut PliantCtx,
    key: *const PliantFlowKey,
) -> c_int {
    call(ctx, |c| {
        c.delete_flow(&key_in(key)?)?;
        Ok(PLIANT_OK)
    })
}

/// Opens a transaction on flow `key` (refcount + 1) and returns its state, valid until the
/// matching `pliant_put_flow`; `*len` (if not NULL) gets its size. NULL on failure with the
/// code in `*err` (if not NULL): PLIANT_ENOTFOUND, PLIANT_EMIGRATED, PLIANT_EFULL.
///
/// # Safety
/// `ctx` an open context; `key` readable; `len`, `err` null or writable.
#[no_mangle]
pub unsafe extern "C" fn pliant_get_flow(
    ctx: *mut PliantCtx,
    key: *const PliantFlowKey,
    len: *mut usize,
    err: *mut c_int,
) -> *mut c_void {
    let mut ptr: *mut c_void = std::ptr::null_mut();
    let code = call(ctx, |c| {
        let (p, n) = c.get_flow(key_in(key)?)?;
        ptr = p as *mut c_void;
        put_out(len, n);
        Ok(PLIANT_OK)
    });
    put_out(err, code);
    if code != PLIANT_OK {
        put_out(len, 0);
        return std::ptr::null_mut();
    }
    ptr
}

/// Ends a transaction opened by `pliant_get_flow(key)`; `modified` bumps the flow's version
/// (the replication layer ships modified flows). PLIANT_ENOTOPEN without an open get.
///
/// # Safety
/// `ctx` an open context; `key` readable.
#[no_mangle]
pub unsafe extern "C" fn pliant_put_flow(
    ctx: *mut PliantCtx,
    key: *const PliantFlowKey,
    modified: bool,
) -> c_int {
    call(ctx, |c| {
        c.put_flow(&key_in(key)?, modified)?;
        Ok(PLIANT_OK)
    })
}

/// Arms timer `timer_id` of flow `key` to fire after `after_ms` (re-arming replaces it). It
/// fires through the `pliant_on_timer` callback and travels with the flow on export.
///
/// # Safety
/// `ctx` an open context; `key` readable.
#[no_mangle]
pub unsafe extern "C" fn pliant_flow_timer(
    ctx: *mut PliantCtx,
    key: *const PliantFlowKey,
    after_ms: u64,
    timer_id: u32,
) -> c_int {
    call(ctx, |c| {
        c.flow_timer(&key_in(key)?, after_ms, timer_id)?;
        Ok(PLIANT_OK)
    })
}

/// Cancels timer `timer_id` of flow `key` (no error if it was not armed).
///
/// # Safety
/// `ctx` an open context; `key` readable.
#[no_mangle]
pub unsafe extern "C" fn pliant_cancel_timer(
    ctx: *mut PliantCtx,
    key: *const PliantFlowKey,
    timer_id: u32,
) -> c_int {
    call(ctx, |c| {
        c.cancel_timer(&key_in(key)?, timer_id)?;
        Ok(PLIANT_OK)
    })
}

/// Registers the callback for expired flow timers (NULL: none; expiries are then counted
/// under the NF counter `c_timers_without_handler`). `user` is passed back unchanged.
///
/// # Safety
/// `ctx` an open context; `cb` callable as documented for `PliantTimerFn`.
#[no_mangle]
pub unsafe extern "C" fn pliant_on_timer(
    ctx: *mut PliantCtx,
    cb: PliantTimerFn,
    user: *mut c_void,
) -> c_int {
    call(ctx, |c| {
        c.timer_cb = cb;
        c.timer_user = user;
        Ok(PLIANT_OK)
    })
}

/// Makes `alias` another key of flow `key` (e.g. a NAT's translated tuple).
///
/// # Safety
/// `ctx` an open context; `key`, `alias` readable.
#[no_mangle]
pub unsafe extern "C" fn pliant_add_alias(
    ctx: *mut PliantCtx,
    key: *const PliantFlowKey,
    alias: *const PliantFlowKey,
) -> c_int {
    call(ctx, |c| {
        c.add_alias(&key_in(key)?, key_in(alias)?)?;
        Ok(PLIANT_OK)
    })
}

/// Removes an alias added with `pliant_add_alias`.
///
/// # Safety
/// `ctx` an open context; `alias` readable.
#[no_mangle]
pub unsafe extern "C" fn pliant_remove_alias(
    ctx: *mut PliantCtx,
    alias: *const PliantFlowKey,
) -> c_int {
    call(ctx, |c| {
        c.remove_alias(&key_in(alias)?)?;
        Ok(PLIANT_OK)
    })
}

/// Exports flow `key` (state, aliases, pending timers, version) into `buf` and removes it
/// here, leaving a MIGRATED tombstone: later `pliant_get_flow(key)` returns PLIANT_EMIGRATED.
/// `*len` gets the record length. If `cap` is too small (or `buf` NULL) nothing changes:
/// PLIANT_ENOSPC with the needed length in `*len`. PLIANT_EBUSY while a get_flow is open.
///
/// # Safety
/// `ctx` an open context; `key` readable; `buf` null or writable for `cap`; `len` writable.
#[no_mangle]
pub unsafe extern "C" fn pliant_export_flow(
    ctx: *mut PliantCtx,
    key: *const PliantFlowKey,
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
) -> c_int {
    call(ctx, |c| {
        if len.is_null() {
            return Err(Error::inval("len is null"));
        }
        let k = key_in(key)?;
        let need = c.export_len(&k)?;
        *len = need;
        if buf.is_null() || cap < need {
            return Err(Error::new(
                PLIANT_ENOSPC,
                format!("export of {k} needs {need} bytes, buffer has {cap}"),
            ));
        }
        let n = c.export_flow(&k, std::slice::from_raw_parts_mut(buf, cap))?;
        *len = n;
        Ok(PLIANT_OK)
    })
}

/// Imports a record made by `pliant_export_flow` (here or on another instance); its timers
/// are re-armed relative to this instance's clock. `*key_out` (if not NULL) gets the flow's
/// key. PLIANT_EDECODE for a corrupt record, PLIANT_EEXIST if the flow lives here already.
///
/// # Safety
/// `ctx` an open context; `buf` readable for `len`; `key_out` null or writable.
#[no_mangle]
pub unsafe extern "C" fn pliant_import_flow(
    ctx: *mut PliantCtx,
    buf: *const u8,
    len: usize,
    key_out: *mut PliantFlowKey,
) -> c_int {
    call(ctx, |c| {
        if buf.is_null() {
            return Err(Error::inval("buf is null"));
        }
        let k = c.import_flow(std::slice::from_raw_parts(buf, len))?;
        put_out(key_out, k.into());
        Ok(PLIANT_OK)
    })
}

/// Live flows in the table.
///
/// # Safety
/// `ctx` null or an open context.
#[no_mangle]
pub unsafe extern "C" fn pliant_flow_count(ctx: *const PliantCtx) -> usize {
    guard(0, || {
        PliantCtx::from_ptr(ctx as *mut PliantCtx).map_or(0, |c| c.engine.ctx.flows.len())
    })
}

// ---- shared ------------------------------------------------------------------------------------

/// Allocates shared state `key` with `len` initial bytes. With a combiner the key is
/// eventually consistent (LOCAL/PULL gets, LOCAL/PUSH puts; the combiner folds other replicas'
/// contributions into the PULL view); without (NULL) it is strongly consistent (SYNCH only).
///
/// # Safety
/// `ctx` an open context; `key` a NUL-terminated string; `init` readable for `len` (or NULL
/// with `len` 0).
#[no_mangle]
pub unsafe extern "C" fn pliant_create_shared(
    ctx: *mut PliantCtx,
    key: *const c_char,
    init: *const u8,
    len: usize,
    combiner: PliantCombinerFn,
) -> c_int {
    call(ctx, |c| {
        let key = cstr(key, "key")?;
        let init = if len == 0 {
            Vec::new()
        } else if init.is_null() {
            return Err(Error::inval("init is null"));
        } else {
            std::slice::from_raw_parts(init, len).to_vec()
        };
        c.create_shared(key, init, combiner)?;
        Ok(PLIANT_OK)
    })
}

/// Frees this replica's copy of shared `key`. PLIANT_EBUSY while a transaction is open.
///
/// # Safety
/// `ctx` an open context; `key` a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn pliant_delete_shared(ctx: *mut PliantCtx, key: *const c_char) -> c_int {
    call(ctx, |c| {
        c.delete_shared(cstr(key, "key")?)?;
        Ok(PLIANT_OK)
    })
}

/// Opens a transaction on shared `key` with `flags` (PLIANT_GET_LOCAL / _PULL / _SYNCH) and
/// fills `*out`; end it with `pliant_put_shared`. PLIANT_EMODE when the flags do not fit the
/// key's consistency, PLIANT_EBUSY (PULL/SYNCH while another transaction on the key is open),
/// PLIANT_ELOCKED (SYNCH: held by another replica).
///
/// # Safety
/// `ctx` an open context; `key` a NUL-terminated string; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn pliant_get_shared(
    ctx: *mut PliantCtx,
    key: *const c_char,
    flags: c_int,
    out: *mut PliantShared,
) -> c_int {
    call(ctx, |c| {
        let key = cstr(key, "key")?;
        if out.is_null() {
            return Err(Error::inval("out is null"));
        }
        *out = c.get_shared(key, flags)?;
        Ok(PLIANT_OK)
    })
}

/// Ends the latest transaction on shared `key` (PLIANT_PUT_LOCAL / _PUSH / _SYNCH). The
/// transaction always ends; an error says what could not be done (e.g. not published).
///
/// # Safety
/// `ctx` an open context; `key` a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn pliant_put_shared(
    ctx: *mut PliantCtx,
    key: *const c_char,
    flags: c_int,
) -> c_int {
    call(ctx, |c| {
        c.put_shared(cstr(key, "key")?, flags)?;
        Ok(PLIANT_OK)
    })
}

// ---- counters ----------------------------------------------------------------------------------

/// Adds `n` to NF counter `name` (`[a-z0-9_]`, at most 64 bytes), exported by the replica as
/// `pliant_nf_<name>_total`.
///
/// # Safety
/// `ctx` an open context; `name` a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn pliant_count(ctx: *mut PliantCtx, name: *const c_char, n: u64) -> c_int {
    call(ctx, |c| {
        let l = label(name, "name")?;
        c.count(l, n);
        Ok(PLIANT_OK)
    })
}

/// Value of NF counter `name` (0 if never counted or on a bad argument).
///
/// # Safety
/// `ctx` null or an open context; `name` null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn pliant_nf_counter(ctx: *const PliantCtx, name: *const c_char) -> u64 {
    guard(0, || {
        let (Some(c), Ok(n)) = (
            PliantCtx::from_ptr(ctx as *mut PliantCtx),
            cstr(name, "name"),
        ) else {
            return 0;
        };
        c.engine.ctx.nf_counters().get(n)
    })
}

/// Packets dropped under `reason` so far, by the program (`pliant_pkt_drop`) or the runtime.
///
/// # Safety
/// `ctx` null or an open context; `reason` null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn pliant_drop_count(ctx: *const PliantCtx, reason: *const c_char) -> u64 {
    guard(0, || {
        let (Some(c), Ok(r)) = (
            PliantCtx::from_ptr(ctx as *mut PliantCtx),
            cstr(reason, "reason"),
        ) else {
            return 0;
        };
        c.engine.ctx.drops().get(r)
    })
}

/// The replica's statistics as one JSON object (as `pliant stats` prints them) into `buf`
/// (NUL-terminated). Returns the JSON length; a value >= `cap` means it was cut.
///
/// # Safety
/// `ctx` null or an open context; `buf` null or writable for `cap`.
#[no_mangle]
pub unsafe extern "C" fn pliant_stats_json(
    ctx: *const PliantCtx,
    buf: *mut c_char,
    cap: usize,
) -> usize {
    guard(0, || {
        let Some(c) = PliantCtx::from_ptr(ctx as *mut PliantCtx) else {
            return 0;
        };
        let s = c.engine.stats_json(c.now()).to_string();
        write_cstr(&s, buf, cap)
    })
}

// ---- in-memory contexts (tests) ----------------------------------------------------------------

/// Queues a frame as received on `side` (PLIANT_SIDE_INSIDE / _OUTSIDE). It reaches the
/// program at the next round (`pliant_pkt_read`).
///
/// # Safety
/// `ctx` an open in-memory context; `frame` readable for `len`.
#[no_mangle]
pub unsafe extern "C" fn pliant_mem_inject(
    ctx: *mut PliantCtx,
    side: c_int,
    frame: *const u8,
    len: usize,
) -> c_int {
    call(ctx, |c| {
        if frame.is_null() {
            return Err(Error::inval("frame is null"));
        }
        c.mem_inject(side_of(side)?, std::slice::from_raw_parts(frame, len))?;
        Ok(PLIANT_OK)
    })
}

/// Takes the oldest frame the replica sent: copies it into `buf`, its length into `*len`, its
/// port into `*side` (if not NULL). PLIANT_ENOTFOUND when none is queued; PLIANT_ENOSPC (the
/// frame stays queued, `*len` = its length) when `cap` is too small.
///
/// # Safety
/// `ctx` an open in-memory context; `buf` writable for `cap`; `side` null or writable; `len`
/// writable.
#[no_mangle]
pub unsafe extern "C" fn pliant_mem_take(
    ctx: *mut PliantCtx,
    side: *mut c_int,
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
) -> c_int {
    call(ctx, |c| {
        if len.is_null() || buf.is_null() {
            return Err(Error::inval("buf or len is null"));
        }
        if let Some(n) = c.mem_front_len() {
            *len = n;
        }
        let (s, f) = c.mem_take(cap)?;
        std::ptr::copy_nonoverlapping(f.as_ptr(), buf, f.len());
        *len = f.len();
        put_out(side, side_code(s));
        Ok(PLIANT_OK)
    })
}

/// Teaches the replica that IPv4 host `ip` (host byte order) on `side` has MAC `mac` (as an
/// ARP request from that host would), so output to it is sent without ARP resolution.
///
/// # Safety
/// `ctx` an open in-memory context; `mac` readable for 6 bytes.
#[no_mangle]
pub unsafe extern "C" fn pliant_mem_learn(
    ctx: *mut PliantCtx,
    side: c_int,
    ip: u32,
    mac: *const u8,
) -> c_int {
    call(ctx, |c| {
        if mac.is_null() {
            return Err(Error::inval("mac is null"));
        }
        let mut m = [0u8; 6];
        m.copy_from_slice(std::slice::from_raw_parts(mac, 6));
        c.mem_learn(side_of(side)?, Ipv4Addr::from(ip), m)?;
        Ok(PLIANT_OK)
    })
}

/// Moves the fake clock forward by `ms`, stopping at each timer deadline on the way to run a
/// round there and deliver the expired timers to the callback.
///
/// # Safety
/// `ctx` an open in-memory context.
#[no_mangle]
pub unsafe extern "C" fn pliant_mem_advance(ctx: *mut PliantCtx, ms: u64) -> c_int {
    call_raw(ctx, "pliant_mem_advance", |p| {
        let target = {
            let c = &mut *p;
            if !c.is_mem() {
                return Err(Error::inval("not an in-memory context"));
            }
            c.now() + Duration::from_millis(ms.min(365 * 24 * 3600 * 1000))
        };
        for _ in 0..MAX_ADVANCE_ROUNDS {
            let more = {
                let c = &mut *p;
                let more = c.mem_step(target);
                c.round();
                more
            };
            dispatch_timers(p);
            if !more {
                return Ok(PLIANT_OK);
            }
        }
        Err(Error::new(
            PLIANT_EBUSY,
            "timers kept re-arming at the same instant",
        ))
    })
}

/// The in-memory port MAC of `side` into `mac` (6 bytes): the destination MAC of frames a test
/// sends to the replica.
///
/// # Safety
/// `ctx` an open context; `mac` writable for 6 bytes.
#[no_mangle]
pub unsafe extern "C" fn pliant_port_mac(ctx: *mut PliantCtx, side: c_int, mac: *mut u8) -> c_int {
    call(ctx, |c| {
        if mac.is_null() {
            return Err(Error::inval("mac is null"));
        }
        let s = side_of(side)?;
        use pliant_io::FramePort;
        let m = c.engine.port_mut(s).mac();
        std::ptr::copy_nonoverlapping(m.as_ptr(), mac, 6);
        Ok(PLIANT_OK)
    })
}

// ---- frames and keys (tests and tools) ---------------------------------------------------------

/// Builds an Ethernet/IPv4/UDP frame with correct checksums into `buf` (addresses in host
/// byte order; `src_mac`/`dst_mac` may be NULL for fixed test MACs). Returns the frame
/// length; if it is larger than `cap`, nothing was written (snprintf-style).
///
/// # Safety
/// `buf` null or writable for `cap`; MACs null or readable for 6 bytes; `payload` readable
/// for `payload_len` (or NULL with 0).
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pliant_build_udp(
    buf: *mut u8,
    cap: usize,
    src_mac: *const u8,
    dst_mac: *const u8,
    src_ip: u32,
    sport: u16,
    dst_ip: u32,
    dport: u16,
    payload: *const u8,
    payload_len: usize,
) -> usize {
    guard(0, || {
        let mac = |p: *const u8, d: [u8; 6]| {
            if p.is_null() {
                d
            } else {
                let mut m = [0u8; 6];
                m.copy_from_slice(std::slice::from_raw_parts(p, 6));
                m
            }
        };
        let pl: &[u8] = if payload.is_null() || payload_len == 0 {
            &[]
        } else {
            std::slice::from_raw_parts(payload, payload_len)
        };
        let f = pliant_net::build::udp(
            mac(src_mac, pliant_net::build::MAC_A),
            mac(dst_mac, MEM_MAC_INSIDE),
            Ipv4Addr::from(src_ip).into(),
            sport,
            Ipv4Addr::from(dst_ip).into(),
            dport,
            pl,
        );
        if !buf.is_null() && f.len() <= cap {
            std::ptr::copy_nonoverlapping(f.as_ptr(), buf, f.len());
        }
        f.len()
    })
}

/// The normalised key of an IPv4 5-tuple (addresses in host byte order).
#[no_mangle]
pub extern "C" fn pliant_key_v4(
    proto: u8,
    src: u32,
    sport: u16,
    dst: u32,
    dport: u16,
) -> PliantFlowKey {
    guard(PliantFlowKey::default(), || {
        FlowKey::v4(
            proto,
            Ipv4Addr::from(src),
            sport,
            Ipv4Addr::from(dst),
            dport,
        )
        .0
        .into()
    })
}

/// Parses a frame; on PLIANT_OK `*key` holds its flow key. PLIANT_EINVAL for non-IP or
/// malformed frames.
///
/// # Safety
/// `frame` readable for `len`; `key` writable.
#[no_mangle]
pub unsafe extern "C" fn pliant_frame_key(
    frame: *const u8,
    len: usize,
    key: *mut PliantFlowKey,
) -> c_int {
    guard(PLIANT_EINVAL, || {
        if frame.is_null() || key.is_null() {
            return PLIANT_EINVAL;
        }
        match pliant_net::parse(std::slice::from_raw_parts(frame, len)) {
            Ok(Frame::Ip(p)) => {
                *key = p.key.into();
                PLIANT_OK
            }
            _ => PLIANT_EINVAL,
        }
    })
}

/// Formats `key` like "udp 10.0.1.2:1000 <-> 10.0.2.2:53" into `buf` (NUL-terminated);
/// returns the text length (a value >= `cap` means it was cut).
///
/// # Safety
/// `key` readable; `buf` null or writable for `cap`.
#[no_mangle]
pub unsafe extern "C" fn pliant_key_format(
    key: *const PliantFlowKey,
    buf: *mut c_char,
    cap: usize,
) -> usize {
    guard(0, || match key_in(key) {
        Ok(k) => write_cstr(&k.to_string(), buf, cap),
        Err(_) => write_cstr("(null key)", buf, cap),
    })
}
