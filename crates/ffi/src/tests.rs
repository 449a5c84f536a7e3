//! The C ABI driven from Rust, through the same `extern "C"` functions C calls.

use crate::*;
use pliant_net::{parse, Frame};
use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int, c_void};
use std::ptr::{null, null_mut};

const CLIENT: u32 = 0x0a00_0102; // 10.0.1.2
const SERVER: u32 = 0x0a00_0202; // 10.0.2.2
const CLIENT_MAC: [u8; 6] = [2, 0, 0, 0, 1, 2];
const SERVER_MAC: [u8; 6] = [2, 0, 0, 0, 2, 2];
const UDP: u8 = 17;

fn err_text(c: *mut PliantCtx) -> String {
    unsafe { CStr::from_ptr(pliant_last_error(c)) }
        .to_string_lossy()
        .into_owned()
}

#[track_caller]
fn ok(c: *mut PliantCtx, rc: c_int) {
    assert_eq!(rc, PLIANT_OK, "{}", err_text(c));
}

fn open() -> *mut PliantCtx {
    let mut err = [0 as c_char; 256];
    let c = unsafe { pliant_open_mem(null(), err.as_mut_ptr(), err.len()) };
    assert!(!c.is_null());
    learn(c);
    c
}

fn learn(c: *mut PliantCtx) {
    unsafe {
        ok(
            c,
            pliant_mem_learn(c, PLIANT_SIDE_INSIDE, CLIENT, CLIENT_MAC.as_ptr()),
        );
        ok(
            c,
            pliant_mem_learn(c, PLIANT_SIDE_OUTSIDE, SERVER, SERVER_MAC.as_ptr()),
        );
    }
}

fn udp_frame(c: *mut PliantCtx, side: c_int, cport: u16) -> Vec<u8> {
    let mut mac = [0u8; 6];
    let mut buf = vec![0u8; 256];
    unsafe {
        ok(c, pliant_port_mac(c, side, mac.as_mut_ptr()));
        let (s, sp, d, dp, smac) = if side == PLIANT_SIDE_INSIDE {
            (CLIENT, cport, SERVER, 53, CLIENT_MAC)
        } else {
            (SERVER, 53, CLIENT, cport, SERVER_MAC)
        };
        let n = pliant_build_udp(
            buf.as_mut_ptr(),
            buf.len(),
            smac.as_ptr(),
            mac.as_ptr(),
            s,
            sp,
            d,
            dp,
            b"hi".as_ptr(),
            2,
        );
        assert!(n > 0 && n <= buf.len());
        buf.truncate(n);
    }
    buf
}

fn inject(c: *mut PliantCtx, side: c_int, cport: u16) {
    let f = udp_frame(c, side, cport);
    unsafe { ok(c, pliant_mem_inject(c, side, f.as_ptr(), f.len())) };
}

fn read(c: *mut PliantCtx) -> Option<*mut PliantPkt> {
    let mut p = null_mut();
    match unsafe { pliant_pkt_read(c, 0, &mut p) } {
        PLIANT_OK => Some(p),
        PLIANT_ETIMEDOUT => None,
        rc => panic!("pkt_read: {rc} {}", err_text(c)),
    }
}

fn take_all(c: *mut PliantCtx) -> Vec<(c_int, Vec<u8>)> {
    let mut out = Vec::new();
    let mut buf = [0u8; 2048];
    loop {
        let (mut side, mut len) = (0, 0);
        match unsafe { pliant_mem_take(c, &mut side, buf.as_mut_ptr(), buf.len(), &mut len) } {
            PLIANT_OK => out.push((side, buf[..len].to_vec())),
            PLIANT_ENOTFOUND => return out,
            rc => panic!("mem_take: {rc}"),
        }
    }
}

fn key(cport: u16) -> PliantFlowKey {
    pliant_key_v4(UDP, CLIENT, cport, SERVER, 53)
}

#[test]
fn read_write_routes_the_packet_out_of_the_other_port() {
    let c = open();
    inject(c, PLIANT_SIDE_INSIDE, 1000);
    let p = read(c).expect("a packet");
    unsafe {
        assert_eq!(pliant_pkt_key(p), key(1000));
        assert_eq!(pliant_pkt_ingress(p), PLIANT_SIDE_INSIDE);
        assert_eq!(pliant_pkt_proto(p), UDP);
        let mut n = 0;
        let pl = pliant_pkt_payload(p, &mut n);
        assert_eq!(std::slice::from_raw_parts(pl, n), b"hi");
        let k = pliant_pkt_key(p);
        ok(c, pliant_pkt_write(c, &k, p));
    }
    assert!(read(c).is_none(), "the round after routes the output");
    let out = take_all(c);
    assert_eq!(out.len(), 1);
    let (side, f) = &out[0];
    assert_eq!(*side, PLIANT_SIDE_OUTSIDE);
    let Ok(Frame::Ip(m)) = parse(f) else {
        panic!("not IP")
    };
    assert_eq!(m.dst_mac, SERVER_MAC, "routed to the learned neighbour");
    assert_eq!(m.ttl, 63, "router role decremented the TTL");
    unsafe { ok(null_mut(), pliant_close(c)) };
}

#[test]
fn rewrites_keep_the_key_in_sync() {
    let c = open();
    inject(c, PLIANT_SIDE_INSIDE, 1000);
    let p = read(c).unwrap();
    unsafe {
        ok(c, pliant_pkt_set_src_port(p, 2000));
        ok(c, pliant_pkt_set_src_ipv4(p, 0x0a00_0201));
        assert_eq!(pliant_pkt_sport(p), 2000);
        assert_eq!(pliant_pkt_src_ipv4(p), 0x0a00_0201);
        let k = pliant_pkt_key(p);
        assert_eq!(k, pliant_key_v4(UDP, 0x0a00_0201, 2000, SERVER, 53));
        let f = std::slice::from_raw_parts(pliant_pkt_data(p), pliant_pkt_len(p));
        let Ok(Frame::Ip(m)) = parse(f) else {
            panic!("not IP")
        };
        assert!(pliant_net::l4_checksum_ok(f, &m), "checksum updated");
        assert!(pliant_net::ipv4_header_ok(f, &m), "IP checksum updated");
        ok(c, pliant_pkt_drop(c, p, c"test_drop".as_ptr()));
        assert_eq!(pliant_drop_count(c, c"test_drop".as_ptr()), 1);
        pliant_close(c);
    }
}

#[test]
fn flow_transactions_and_misuse() {
    let c = open();
    let k = key(1);
    unsafe {
        let mut e = 0;
        let mut len = 0;
        assert!(pliant_get_flow(c, &k, &mut len, &mut e).is_null());
        assert_eq!(e, PLIANT_ENOTFOUND);
        ok(c, pliant_create_flow(c, &k, 4));
        let st = pliant_get_flow(c, &k, &mut len, &mut e) as *mut u8;
        assert!(!st.is_null());
        assert_eq!(len, 4);
        assert_eq!(std::slice::from_raw_parts(st, 4), [0; 4], "zero-filled");
        *st = 9;
        // Nested transaction on the same flow sees the write; the pointer is stable.
        let st2 = pliant_get_flow(c, &k, null_mut(), &mut e) as *mut u8;
        assert_eq!(st2, st);
        assert_eq!(pliant_delete_flow(c, &k), PLIANT_EBUSY);
        ok(c, pliant_put_flow(c, &k, true));
        ok(c, pliant_put_flow(c, &k, false));
        assert_eq!(pliant_put_flow(c, &k, false), PLIANT_ENOTOPEN);
        assert!(err_text(c).contains("without an open get_flow"));
        let st = pliant_get_flow(c, &k, null_mut(), &mut e) as *mut u8;
        assert_eq!(*st, 9);
        ok(c, pliant_put_flow(c, &k, false));
        let (ref_flows, ref_shared, held) = PliantCtx::from_ptr(c).unwrap().open_refs();
        assert_eq!((ref_flows, ref_shared, held), (0, 0, 0));
        ok(c, pliant_delete_flow(c, &k));
        assert_eq!(pliant_flow_count(c), 0);
        pliant_close(c);
    }
}

#[test]
fn null_pointers_are_refused_not_dereferenced() {
    let c = open();
    let k = key(1);
    let mut e = 0;
    unsafe {
        assert_eq!(pliant_create_flow(null_mut(), &k, 1), PLIANT_EINVAL);
        assert_eq!(pliant_create_flow(c, null(), 1), PLIANT_EINVAL);
        assert!(pliant_get_flow(c, null(), null_mut(), &mut e).is_null());
        assert_eq!(e, PLIANT_EINVAL);
        assert_eq!(pliant_put_flow(c, null(), true), PLIANT_EINVAL);
        assert_eq!(pliant_pkt_read(c, 0, null_mut()), PLIANT_EINVAL);
        assert_eq!(pliant_pkt_write(c, &k, null_mut()), PLIANT_EINVAL);
        assert_eq!(pliant_pkt_write_direct(c, null_mut()), PLIANT_EINVAL);
        assert_eq!(
            pliant_export_flow(c, &k, null_mut(), 0, null_mut()),
            PLIANT_EINVAL
        );
        assert_eq!(pliant_import_flow(c, null(), 0, null_mut()), PLIANT_EINVAL);
        assert_eq!(
            pliant_create_shared(c, null(), null(), 0, None),
            PLIANT_EINVAL
        );
        assert_eq!(
            pliant_get_shared(c, c"x".as_ptr(), 0, null_mut()),
            PLIANT_EINVAL
        );
        assert_eq!(pliant_mem_inject(c, 0, null(), 0), PLIANT_EINVAL);
        assert_eq!(pliant_mem_inject(c, 7, [0u8].as_ptr(), 1), PLIANT_EINVAL);
        assert_eq!(pliant_pkt_len(null()), 0);
        assert!(pliant_pkt_data(null()).is_null());
        assert_eq!(pliant_pkt_key(null()), PliantFlowKey::default());
        assert_eq!(pliant_pkt_set_egress(null_mut(), 0), PLIANT_EINVAL);
        assert_eq!(pliant_nf_counter(null(), null()), 0);
        assert_eq!(pliant_flow_count(null()), 0);
        assert!(!pliant_last_error(null()).is_null());
        assert_eq!(pliant_frame_key(null(), 0, null_mut()), PLIANT_EINVAL);
        assert_eq!(pliant_close(null_mut()), PLIANT_EINVAL);
        pliant_close(c);
    }
}

#[test]
fn packets_written_twice_or_from_another_context_are_refused() {
    let c = open();
    let other = open();
    inject(c, PLIANT_SIDE_INSIDE, 1);
    inject(other, PLIANT_SIDE_INSIDE, 1);
    let p = read(c).unwrap();
    let q = read(other).unwrap();
    let k = key(1);
    unsafe {
        assert_eq!(pliant_pkt_write(c, &k, q), PLIANT_EINVAL);
        assert!(err_text(c).contains("does not belong"));
        ok(c, pliant_pkt_write(c, &k, p));
        assert_eq!(pliant_pkt_write(c, &k, p), PLIANT_ENOTOPEN);
        assert_eq!(pliant_pkt_drop(c, p, null()), PLIANT_ENOTOPEN);
        assert_eq!(pliant_pkt_len(p), 0, "a released slot reads as empty");
        ok(other, pliant_pkt_drop(other, q, null()));
        assert_eq!(pliant_drop_count(other, c"c_drop".as_ptr()), 1);
        pliant_close(c);
        pliant_close(other);
    }
}

#[test]
fn holding_too_many_packets_is_efull_and_bounded_queues_count_drops() {
    let c = open();
    for i in 0..300u16 {
        inject(c, PLIANT_SIDE_INSIDE, 1000 + i);
    }
    let mut held = Vec::new();
    let mut p = null_mut();
    let rc = loop {
        match unsafe { pliant_pkt_read(c, 0, &mut p) } {
            PLIANT_OK => held.push(p),
            rc => break rc,
        }
    };
    assert_eq!(rc, PLIANT_EFULL);
    assert_eq!(held.len(), 256);
    for p in held {
        unsafe { ok(c, pliant_pkt_drop(c, p, null())) };
    }
    // The rest is still there.
    let mut n = 0;
    while let Some(p) = read(c) {
        unsafe { ok(c, pliant_pkt_drop(c, p, null())) };
        n += 1;
    }
    assert_eq!(n, 44);

    // Rounds without reads fill the inbox up to its bound; the excess is counted.
    for i in 0..1100u16 {
        inject(c, PLIANT_SIDE_INSIDE, i);
    }
    for _ in 0..40 {
        unsafe { ok(c, pliant_flush(c)) };
    }
    let dropped = unsafe { pliant_drop_count(c, c"c_inbox_full".as_ptr()) };
    assert_eq!(dropped, 1100 - 1024);
    unsafe { pliant_close(c) };
}

struct Fired {
    ctx: *mut PliantCtx,
    keys: Vec<(PliantFlowKey, u32)>,
    reentry: c_int,
    close: c_int,
    get_in_cb: c_int,
}

unsafe extern "C" fn on_timer(
    ctx: *mut PliantCtx,
    key: *const PliantFlowKey,
    id: u32,
    user: *mut c_void,
) {
    let f = &mut *(user as *mut Fired);
    assert_eq!(ctx, f.ctx);
    f.keys.push((*key, id));
    let mut p = null_mut();
    f.reentry = pliant_pkt_read(ctx, 0, &mut p);
    f.close = pliant_close(ctx);
    // State calls are allowed from the callback.
    let mut e = 0;
    if !pliant_get_flow(ctx, key, null_mut(), &mut e).is_null() {
        pliant_put_flow(ctx, key, false);
    }
    f.get_in_cb = e;
}

#[test]
fn timers_fire_through_the_callback_in_fake_time() {
    let c = open();
    let mut fired = Fired {
        ctx: c,
        keys: Vec::new(),
        reentry: 0,
        close: 0,
        get_in_cb: -99,
    };
    unsafe {
        ok(c, pliant_create_flow(c, &key(1), 1));
        ok(c, pliant_create_flow(c, &key(2), 1));
        ok(c, pliant_flow_timer(c, &key(1), 100, 5));
        ok(c, pliant_flow_timer(c, &key(2), 300, 6));
        // Without a handler expiries are counted, not lost silently.
        ok(c, pliant_mem_advance(c, 100));
        assert_eq!(
            pliant_nf_counter(c, c"c_timers_without_handler".as_ptr()),
            1
        );
        ok(
            c,
            pliant_on_timer(c, Some(on_timer), &mut fired as *mut Fired as *mut c_void),
        );
        ok(c, pliant_mem_advance(c, 199));
        assert!(fired.keys.is_empty(), "not due before 300 ms");
        ok(c, pliant_mem_advance(c, 1));
        assert_eq!(fired.keys, vec![(key(2), 6)]);
        assert_eq!(fired.reentry, PLIANT_EBUSY);
        assert_eq!(fired.close, PLIANT_EBUSY);
        assert_eq!(fired.get_in_cb, PLIANT_OK);
        // The context survived the refused close.
        ok(c, pliant_flow_timer(c, &key(2), 0, 6));
        ok(c, pliant_flush(c));
        assert_eq!(fired.keys.len(), 2);
        ok(c, pliant_close(c));
    }
}

unsafe extern "C" fn max_u8(acc: *mut u8, n: usize, other: *const u8, m: usize) {
    if n == 1 && m == 1 && *other > *acc {
        *acc = *other;
    }
}

#[test]
fn migration_between_peers_and_a_c_combiner() {
    let a = open();
    let mut err = [0 as c_char; 128];
    let b = unsafe { pliant_open_mem_peer(a, err.as_mut_ptr(), err.len()) };
    assert!(!b.is_null());
    learn(b);
    let k = key(7);
    let mut rec = vec![0u8; 512];
    let mut len = 0;
    unsafe {
        ok(a, pliant_create_flow(a, &k, 3));
        let st = pliant_get_flow(a, &k, null_mut(), null_mut()) as *mut u8;
        *st.add(2) = 42;
        ok(a, pliant_put_flow(a, &k, true));
        ok(a, pliant_flow_timer(a, &k, 1000, 1));
        assert_eq!(
            pliant_export_flow(a, &k, rec.as_mut_ptr(), 1, &mut len),
            PLIANT_ENOSPC
        );
        assert_eq!(pliant_flow_count(a), 1, "a short buffer loses nothing");
        ok(
            a,
            pliant_export_flow(a, &k, rec.as_mut_ptr(), rec.len(), &mut len),
        );
        let mut e = 0;
        assert!(pliant_get_flow(a, &k, null_mut(), &mut e).is_null());
        assert_eq!(e, PLIANT_EMIGRATED);
        let mut got = PliantFlowKey::default();
        ok(b, pliant_import_flow(b, rec.as_ptr(), len, &mut got));
        assert_eq!(got, k);
        let mut n = 0;
        let st = pliant_get_flow(b, &k, &mut n, null_mut()) as *const u8;
        assert_eq!((n, *st.add(2)), (3, 42));
        ok(b, pliant_put_flow(b, &k, false));
        assert_eq!(
            pliant_import_flow(b, rec.as_ptr(), 5, null_mut()),
            PLIANT_EDECODE
        );

        // Shared max over two replicas through a C combiner.
        for (c, v) in [(a, 3u8), (b, 8u8)] {
            ok(
                c,
                pliant_create_shared(c, c"hi".as_ptr(), [0u8].as_ptr(), 1, Some(max_u8)),
            );
            let mut sh = PliantShared {
                view: null(),
                view_len: 0,
                value: null_mut(),
                value_len: 0,
            };
            ok(
                c,
                pliant_get_shared(c, c"hi".as_ptr(), PLIANT_GET_LOCAL, &mut sh),
            );
            *sh.value = v;
            ok(c, pliant_put_shared(c, c"hi".as_ptr(), PLIANT_PUT_PUSH));
        }
        let mut sh = PliantShared {
            view: null(),
            view_len: 0,
            value: null_mut(),
            value_len: 0,
        };
        ok(
            a,
            pliant_get_shared(a, c"hi".as_ptr(), PLIANT_GET_PULL, &mut sh),
        );
        assert_eq!((sh.view_len, *sh.view, *sh.value), (1, 8, 3));
        assert_eq!(
            pliant_get_shared(a, c"hi".as_ptr(), 9, &mut sh),
            PLIANT_EINVAL
        );
        ok(a, pliant_put_shared(a, c"hi".as_ptr(), PLIANT_PUT_LOCAL));
        pliant_close(b);
        pliant_close(a);
    }
}

#[test]
fn config_is_read_and_validated() {
    let dir = std::env::temp_dir().join(format!("pliant-ffi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good.toml");
    let text = r#"
[replica]
name = "c1"
control_socket = "/tmp/pliant-ffi-c1.sock"

[inside]
ifname = "c1in"
addresses = ["10.9.1.1/24"]

[outside]
ifname = "c1out"
addresses = ["10.9.2.1/24"]

[nf]
kind = "c"

[c]
quota_packets = 7
"#;
    std::fs::write(&good, text).unwrap();
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, text.replace("kind = \"c\"", "kind = \"nat\"")).unwrap();
    let path = |p: &std::path::Path| CString::new(p.to_str().unwrap()).unwrap();
    let mut err = [0 as c_char; 256];
    unsafe {
        let c = pliant_open_mem(path(&good).as_ptr(), err.as_mut_ptr(), err.len());
        assert!(!c.is_null());
        let mut v = 0i64;
        ok(c, pliant_config_int(c, c"quota_packets".as_ptr(), &mut v));
        assert_eq!(v, 7);
        assert_eq!(
            pliant_config_int(c, c"idle_ms".as_ptr(), &mut v),
            PLIANT_ENOTFOUND
        );
        pliant_close(c);
        let c = pliant_open_mem(path(&bad).as_ptr(), err.as_mut_ptr(), err.len());
        assert!(c.is_null());
        let msg = CStr::from_ptr(err.as_ptr()).to_string_lossy();
        assert!(msg.contains("kind = \"c\""), "{msg}");
        let c = pliant_open(c"/nonexistent/x.toml".as_ptr(), err.as_mut_ptr(), 16);
        assert!(c.is_null());
        assert_eq!(
            CStr::from_ptr(err.as_ptr()).to_bytes().len(),
            15,
            "cut to cap"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stats_json_and_strerror() {
    let c = open();
    unsafe {
        let n = pliant_stats_json(c, null_mut(), 0);
        assert!(n > 10);
        let mut buf = vec![0 as c_char; n + 1];
        assert_eq!(pliant_stats_json(c, buf.as_mut_ptr(), buf.len()), n);
        let s = CStr::from_ptr(buf.as_ptr()).to_str().unwrap();
        let v: serde_json::Value = serde_json::from_str(s).unwrap();
        assert_eq!(v["nf"], "c");
        assert_eq!(
            CStr::from_ptr(pliant_strerror(PLIANT_EMIGRATED)).to_str(),
            Ok("PLIANT_EMIGRATED")
        );
        let mut kb = [0 as c_char; 64];
        let k = key(1000);
        pliant_key_format(&k, kb.as_mut_ptr(), kb.len());
        assert_eq!(
            CStr::from_ptr(kb.as_ptr()).to_str(),
            Ok("udp 10.0.1.2:1000 <-> 10.0.2.2:53")
        );
        assert_eq!(pliant_count(c, c"Bad".as_ptr(), 1), PLIANT_EINVAL);
        ok(c, pliant_count(c, c"good_one".as_ptr(), 2));
        assert_eq!(pliant_nf_counter(c, c"good_one".as_ptr()), 2);
        pliant_close(c);
    }
}
