//! Model-based test of the session state tracking: seeded random sequences of statements
//! that change session state (SET, SET LOCAL, set_config, RESET [ALL], savepoints,
//! PREPARE/DEALLOCATE, DISCARD, transaction control, named protocol-level statements) and
//! failovers between requests. A model of PostgreSQL answers the requests (it is the
//! server) and holds what PostgreSQL would hold; after every request the state the proxy
//! would replay is compared with it, and at a failover the replay is run on a fresh model
//! server (every statement must succeed there and rebuild the same state).

use super::tests::parse as parse_frame;
use super::*;
use pliant_testkit::XorShift;
use std::collections::{BTreeMap, BTreeSet};

type Vals = BTreeMap<String, String>;

/// One statement of the generated language.
#[derive(Clone, Debug)]
enum S {
    Set(String, String),
    SetSession(String, String),
    SetLocal(String, String),
    Config(String, String, bool),
    Reset(String),
    ResetAll,
    Savepoint(String),
    Release(String),
    RollbackTo(String),
    Prepare(String),
    Deallocate(String, bool),
    DeallocateAll,
    DiscardAll,
    DiscardPlans,
    Begin,
    Commit(bool),
    Rollback,
    Fail,
}

impl S {
    fn sql(&self) -> String {
        match self {
            S::Set(k, v) => format!("SET {k} = '{v}'"),
            S::SetSession(k, v) => format!("SET SESSION {k} TO '{v}'"),
            S::SetLocal(k, v) => format!("SET LOCAL {k} = '{v}'"),
            S::Config(k, v, local) => format!("SELECT set_config('{k}', '{v}', {local})"),
            S::Reset(k) => format!("RESET {k}"),
            S::ResetAll => "RESET ALL".into(),
            S::Savepoint(n) => format!("SAVEPOINT {n}"),
            S::Release(n) => format!("RELEASE SAVEPOINT {n}"),
            S::RollbackTo(n) => format!("ROLLBACK TO SAVEPOINT {n}"),
            S::Prepare(n) => format!("PREPARE {n} AS SELECT 1"),
            S::Deallocate(n, false) => format!("DEALLOCATE {n}"),
            S::Deallocate(n, true) => format!("DEALLOCATE PREPARE {n}"),
            S::DeallocateAll => "DEALLOCATE ALL".into(),
            S::DiscardAll => "DISCARD ALL".into(),
            S::DiscardPlans => "DISCARD PLANS".into(),
            S::Begin => "BEGIN".into(),
            S::Commit(false) => "COMMIT".into(),
            S::Commit(true) => "END".into(),
            S::Rollback => "ROLLBACK".into(),
            S::Fail => "SELECT 1/0".into(),
        }
    }
}

/// One client request.
#[derive(Clone, Debug)]
enum Op {
    /// A simple query of one or more statements.
    Query(Vec<S>),
    /// Parse of a named statement, Sync.
    Parse(String),
    /// Close of a named statement, Sync.
    Close(String),
    /// A SET with the extended protocol (unnamed Parse, Bind, Execute, Sync).
    ExtSet(String, String),
    /// The primary fails between requests; the session moves.
    Failover,
}

#[derive(Clone, Debug)]
struct Tx {
    explicit: bool,
    failed: bool,
    /// The values when the transaction and each savepoint began.
    saves: Vec<(Option<String>, Vals)>,
}

/// What PostgreSQL holds for one session (the settings the generator touches).
#[derive(Clone, Debug, Default)]
struct Pg {
    vals: Vals,
    /// Custom settings ever named by a statement that ran: PostgreSQL keeps them defined
    /// (value '' when unset) for the session's life, through RESET, DISCARD and rollbacks.
    defined: BTreeSet<String>,
    prepared: BTreeSet<String>,
    tx: Option<Tx>,
}

impl Pg {
    fn status(&self) -> u8 {
        match &self.tx {
            None => b'I',
            Some(t) if t.failed => b'E',
            Some(_) => b'T',
        }
    }

    /// The settings that outlive the open transaction if it is lost.
    fn committed(&self) -> &Vals {
        self.tx
            .as_ref()
            .map(|t| &t.saves[0].1)
            .unwrap_or(&self.vals)
    }

    fn begin_implicit(&mut self) {
        if self.tx.is_none() {
            self.tx = Some(Tx {
                explicit: false,
                failed: false,
                saves: vec![(None, self.vals.clone())],
            });
        }
    }

    /// After an error: an explicit block fails, an implicit transaction rolls back.
    fn on_error(&mut self) {
        match self.tx.take() {
            Some(mut t) if t.explicit => {
                t.failed = true;
                self.tx = Some(t);
            }
            Some(t) => self.vals = t.saves[0].1.clone(),
            None => {}
        }
    }

    /// The end of a request: an implicit transaction commits.
    fn end_request(&mut self) {
        if self.tx.as_ref().is_some_and(|t| !t.explicit) {
            self.tx = None;
        }
    }

    /// Runs one statement as PostgreSQL 15 does: its command tag, or `None` for an error.
    fn exec(&mut self, s: &S, multi: bool) -> Option<&'static str> {
        if self.tx.as_ref().is_some_and(|t| t.failed)
            && !matches!(s, S::Commit(_) | S::Rollback | S::RollbackTo(_))
        {
            return None;
        }
        self.begin_implicit();
        if let S::Set(k, _)
        | S::SetSession(k, _)
        | S::SetLocal(k, _)
        | S::Config(k, _, _)
        | S::Reset(k) = s
        {
            self.defined.insert(k.clone());
        }
        let tx = self.tx.as_mut()?;
        let savepoint = |tx: &Tx, n: &str| {
            tx.saves
                .iter()
                .rposition(|(name, _)| name.as_deref() == Some(n))
                .filter(|i| *i > 0 && tx.explicit)
        };
        Some(match s {
            S::Set(k, v) | S::SetSession(k, v) => {
                self.vals.insert(k.clone(), v.clone());
                "SET"
            }
            S::Config(k, v, local) => {
                if !local {
                    self.vals.insert(k.clone(), v.clone());
                }
                "SELECT 1"
            }
            // Ends with the transaction: no lasting value.
            S::SetLocal(..) => "SET",
            S::Reset(k) => {
                self.vals.remove(k);
                "RESET"
            }
            S::ResetAll => {
                self.vals.clear();
                "RESET"
            }
            S::Savepoint(n) => {
                if !tx.explicit {
                    return None;
                }
                tx.saves.push((Some(n.clone()), self.vals.clone()));
                "SAVEPOINT"
            }
            S::Release(n) => {
                let i = savepoint(tx, n)?;
                tx.saves.truncate(i);
                "RELEASE"
            }
            S::RollbackTo(n) => {
                let i = savepoint(tx, n)?;
                self.vals = tx.saves[i].1.clone();
                tx.saves.truncate(i + 1);
                tx.failed = false;
                "ROLLBACK"
            }
            S::Prepare(n) => {
                if !self.prepared.insert(n.clone()) {
                    return None;
                }
                "PREPARE"
            }
            S::Deallocate(n, _) => {
                if !self.prepared.remove(n) {
                    return None;
                }
                "DEALLOCATE"
            }
            S::DeallocateAll => {
                self.prepared.clear();
                "DEALLOCATE ALL"
            }
            S::DiscardAll => {
                // Not inside a block, nor in a multi-statement query (implicit block).
                if tx.explicit || multi {
                    return None;
                }
                self.vals.clear();
                self.prepared.clear();
                "DISCARD ALL"
            }
            S::DiscardPlans => "DISCARD PLANS",
            S::Begin => {
                tx.explicit = true;
                "BEGIN"
            }
            S::Commit(_) => {
                let t = self.tx.take()?;
                if t.failed {
                    self.vals = t.saves[0].1.clone();
                    "ROLLBACK"
                } else {
                    "COMMIT"
                }
            }
            S::Rollback => {
                let t = self.tx.take()?;
                self.vals = t.saves[0].1.clone();
                "ROLLBACK"
            }
            S::Fail => return None,
        })
    }

    /// The server's answers to a simple query.
    fn query(&mut self, stmts: &[S]) -> Vec<Frame> {
        let mut out = Vec::new();
        for s in stmts {
            match self.exec(s, stmts.len() > 1) {
                Some(tag) => out.push(proto::command_complete(tag)),
                None => {
                    out.push(error("22012"));
                    self.on_error();
                    break;
                }
            }
        }
        self.end_request();
        out.push(proto::ready_for_query(self.status()));
        out
    }

    /// The server's answers to the txid query the proxy injects.
    fn txid_answers(&self) -> Vec<Frame> {
        if self.status() == b'E' {
            return vec![error("25P02"), proto::ready_for_query(b'E')];
        }
        let mut row = vec![0, 1];
        row.extend((-1i32).to_be_bytes());
        vec![
            Frame::new(b'D', row),
            proto::command_complete("SELECT 1"),
            proto::ready_for_query(self.status()),
        ]
    }
}

fn error(code: &str) -> Frame {
    proto::error_response("ERROR", code, "model")
}

/// A session through the proxy's state machine, with the model as its server.
struct Run {
    st: SessionState,
    pg: Pg,
    /// Rendered statement -> statement, to run a replay on the model.
    known: BTreeMap<String, S>,
    /// The open block was aborted by a failover and not ended yet.
    lost: bool,
    log: Vec<String>,
}

impl Run {
    fn new() -> Run {
        Run {
            st: SessionState::new(vec![]),
            pg: Pg::default(),
            known: BTreeMap::new(),
            lost: false,
            log: Vec::new(),
        }
    }

    fn fail(&self, what: &str) -> ! {
        panic!("{what}\nsequence:\n  {}", self.log.join("\n  "))
    }

    /// Sends the client frames of one request; returns what the client receives.
    fn request(
        &mut self,
        frames: Vec<Frame>,
        answer: impl FnOnce(&mut Pg, &[Frame]) -> Vec<Frame>,
    ) -> Vec<Frame> {
        let mut sent = Vec::new();
        let (mut before, mut after) = (false, false);
        let mut to_client = Vec::new();
        let mut skipping = false;
        for f in frames {
            if skipping {
                if f.tag == b'S' {
                    to_client.push(proto::ready_for_query(self.st.status));
                }
                continue;
            }
            match self.st.on_client(&f) {
                ClientAction::Forward {
                    inject_before,
                    inject_after,
                    ..
                } => {
                    before |= inject_before;
                    after |= inject_after;
                    sent.push(f);
                }
                ClientAction::Substitute(g) => sent.push(g),
                ClientAction::Reply {
                    frames,
                    skip_to_sync,
                } => {
                    to_client.extend(frames);
                    skipping = skip_to_sync;
                }
                a => self.fail(&format!("unexpected {a:?}")),
            }
        }
        if sent.is_empty() {
            return to_client;
        }
        let mut server = Vec::new();
        if before {
            server.extend(self.pg.txid_answers());
        }
        server.extend(answer(&mut self.pg, &sent));
        if after {
            server.extend(self.pg.txid_answers());
        }
        for f in &server {
            match self.st.on_server(f) {
                ServerAction::Forward => to_client.push(f.clone()),
                ServerAction::Replace(g) => to_client.push(g),
                ServerAction::Swallow => {}
            }
        }
        to_client
    }

    fn op(&mut self, op: &Op) {
        self.log.push(format!("{op:?}"));
        let out = match op {
            Op::Query(stmts) => {
                let sql: Vec<String> = stmts.iter().map(S::sql).collect();
                for (t, s) in sql.iter().zip(stmts) {
                    self.known.insert(t.clone(), s.clone());
                }
                let commit_first = matches!(stmts.first(), Some(S::Commit(_)));
                let lost = self.lost;
                let stmts = stmts.clone();
                let out = self.request(vec![proto::query(&sql.join("; "))], |pg, sent| {
                    // The proxy may have sent something else (a ROLLBACK for a lost COMMIT).
                    let text = proto::cstr(&sent[0].body).map(|(s, _)| s).unwrap_or("");
                    if text == "ROLLBACK" && !matches!(stmts.first(), Some(S::Rollback)) {
                        pg.query(&[S::Rollback])
                    } else {
                        pg.query(&stmts)
                    }
                });
                if lost && commit_first {
                    // A COMMIT of a transaction the failover aborted fails, session idle.
                    let codes: Vec<String> = out
                        .iter()
                        .filter(|f| f.tag == b'E')
                        .filter_map(|f| proto::error_field(&f.body, b'C'))
                        .collect();
                    if codes != ["40001"] || out.last() != Some(&proto::ready_for_query(b'I')) {
                        self.fail(&format!("lost COMMIT answered {out:?}"));
                    }
                }
                out
            }
            Op::Parse(n) => {
                let frames = vec![parse_frame(n, "SELECT 1"), Frame::new(b'S', vec![])];
                let n = n.clone();
                self.request(frames, move |pg, _| {
                    if pg.status() == b'E' || !pg.prepared.insert(n) {
                        pg.on_error();
                        return vec![error("42P05"), proto::ready_for_query(pg.status())];
                    }
                    vec![
                        Frame::new(b'1', vec![]),
                        proto::ready_for_query(pg.status()),
                    ]
                })
            }
            Op::Close(n) => {
                let mut body = vec![b'S'];
                proto::put_cstr(&mut body, n);
                let frames = vec![Frame::new(b'C', body), Frame::new(b'S', vec![])];
                let n = n.clone();
                self.request(frames, move |pg, _| {
                    pg.prepared.remove(&n);
                    vec![
                        Frame::new(b'3', vec![]),
                        proto::ready_for_query(pg.status()),
                    ]
                })
            }
            Op::ExtSet(k, v) => {
                let s = S::Set(k.clone(), v.clone());
                self.known.insert(s.sql(), s.clone());
                let mut bind = Vec::new();
                proto::put_cstr(&mut bind, "");
                proto::put_cstr(&mut bind, "");
                bind.extend([0, 0, 0, 0, 0, 0]);
                let frames = vec![
                    parse_frame("", &s.sql()),
                    Frame::new(b'B', bind),
                    Frame::new(b'E', vec![0, 0, 0, 0, 0]),
                    Frame::new(b'S', vec![]),
                ];
                self.request(frames, move |pg, _| {
                    let mut out = Vec::new();
                    match pg.exec(&s, false) {
                        Some(tag) => out.extend([
                            Frame::new(b'1', vec![]),
                            Frame::new(b'2', vec![]),
                            proto::command_complete(tag),
                        ]),
                        None => {
                            out.push(error("25P02"));
                            pg.on_error();
                        }
                    }
                    pg.end_request();
                    out.push(proto::ready_for_query(pg.status()));
                    out
                })
            }
            Op::Failover => {
                self.failover();
                Vec::new()
            }
        };
        if self.pg.status() == b'I' {
            self.lost = false;
        }
        let shown = out.iter().rev().find(|f| f.tag == b'Z').map(|f| f.body[0]);
        if let Some(z) = shown {
            if z != self.st.status || (z != self.pg.status() && !self.lost) {
                self.fail(&format!(
                    "status: client saw {}, proxy has {}, server {}",
                    z as char,
                    self.st.status as char,
                    self.pg.status() as char
                ));
            }
        }
        self.compare();
    }

    /// What the proxy would replay equals what PostgreSQL holds beyond the open transaction.
    fn compare(&self) {
        let replayed = self.replay_on_fresh_server();
        if replayed.vals != *self.pg.committed()
            || replayed.prepared != self.pg.prepared
            || replayed.defined != self.pg.defined
        {
            self.fail(&format!(
                "replay gives {:?} {:?} {:?}, PostgreSQL holds {:?} {:?} {:?}",
                replayed.vals,
                replayed.prepared,
                replayed.defined,
                self.pg.committed(),
                self.pg.prepared,
                self.pg.defined
            ));
        }
    }

    /// Runs the proxy's replay on a fresh model server; every statement must succeed.
    fn replay_on_fresh_server(&self) -> Pg {
        let mut fresh = Pg::default();
        let (frames, zs) = self.st.replay_frames();
        let mut seen_zs = 0;
        for f in &frames {
            match f.tag {
                b'Q' => {
                    let sql = proto::cstr(&f.body).map(|(s, _)| s).unwrap_or("");
                    // A placeholder is defined again by RESET, which the client need not
                    // have sent itself.
                    let placeholder = sql
                        .strip_prefix("RESET ")
                        .filter(|k| k.contains('.'))
                        .map(|k| S::Reset(k.to_string()));
                    let Some(s) = self.known.get(sql).or(placeholder.as_ref()) else {
                        self.fail(&format!("replay of a statement never sent: {sql:?}"));
                    };
                    let out = fresh.query(std::slice::from_ref(s));
                    if out.iter().any(|f| f.tag == b'E') {
                        self.fail(&format!("replaying {sql:?} fails"));
                    }
                    seen_zs += 1;
                }
                b'P' => {
                    let name = proto::cstr(&f.body).map(|(s, _)| s).unwrap_or("");
                    if !fresh.prepared.insert(name.to_string()) {
                        self.fail(&format!("replay parses {name:?} twice"));
                    }
                }
                b'S' => seen_zs += 1,
                t => self.fail(&format!("replay frame {t}")),
            }
        }
        if seen_zs != zs {
            self.fail(&format!(
                "replay announces {zs} ReadyForQuery, sends {seen_zs}"
            ));
        }
        fresh
    }

    /// The primary fails between requests: the proxy replays on a fresh server, and puts it
    /// into a failed block if the session was in one (as proxy.rs does).
    fn failover(&mut self) {
        let mut fresh = self.replay_on_fresh_server();
        self.st.resent();
        if self.st.moved_between_requests() {
            self.lost |= self.pg.status() == b'T';
            fresh.tx = Some(Tx {
                explicit: true,
                failed: true,
                saves: vec![(None, fresh.vals.clone())],
            });
        }
        self.pg = fresh;
    }
}

fn pick<'a>(r: &mut XorShift, xs: &[&'a str]) -> &'a str {
    xs[r.below(xs.len() as u64) as usize]
}

fn random_stmt(r: &mut XorShift) -> S {
    let k = pick(r, &["pl.a", "pl.b", "pl.c"]).to_string();
    let v = pick(r, &["v0", "v1", "v2", "v3"]).to_string();
    let sp = pick(r, &["s1", "s2"]).to_string();
    let p = pick(r, &["p1", "p2", "p3"]).to_string();
    match r.below(23) {
        0 | 1 => S::Set(k, v),
        2 => S::SetSession(k, v),
        3 => S::SetLocal(k, v),
        4 => S::Config(k, v, false),
        5 => S::Config(k, v, true),
        6 => S::Reset(k),
        7 => S::ResetAll,
        8 | 9 => S::Savepoint(sp),
        10 => S::Release(sp),
        11 => S::RollbackTo(sp),
        12 => S::Prepare(p),
        13 => S::Deallocate(p, r.below(2) == 0),
        14 => S::DeallocateAll,
        15 => S::DiscardAll,
        16 => S::DiscardPlans,
        17 | 18 => S::Begin,
        19 => S::Commit(r.below(3) == 0),
        20 => S::Rollback,
        _ => S::Fail,
    }
}

fn random_op(r: &mut XorShift) -> Op {
    let p = pick(r, &["p1", "p2", "p3"]).to_string();
    match r.below(20) {
        0 => Op::Failover,
        1 => Op::Parse(p),
        2 => Op::Close(p),
        3 => Op::ExtSet(
            pick(r, &["pl.a", "pl.b"]).to_string(),
            pick(r, &["x0", "x1"]).to_string(),
        ),
        4..=6 => Op::Query((0..2 + r.below(2)).map(|_| random_stmt(r)).collect()),
        _ => Op::Query(vec![random_stmt(r)]),
    }
}

fn run(ops: &[Op]) {
    let mut run = Run::new();
    for op in ops {
        run.op(op);
    }
    run.op(&Op::Failover);
}

#[test]
fn seeded_random_sequences_replay_what_postgres_holds() {
    for seed in 1..=400u64 {
        let mut r = XorShift(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let ops: Vec<Op> = (0..60).map(|_| random_op(&mut r)).collect();
        let res = std::panic::catch_unwind(|| run(&ops));
        assert!(res.is_ok(), "seed {seed} failed (see the panic above)");
    }
}

#[test]
fn regression_cases_of_the_failover_fixes() {
    let q = |s: Vec<S>| Op::Query(s);
    let set = |k: &str, v: &str| S::Set(k.into(), v.into());
    let cases = vec![
        // SET before a savepoint survives ROLLBACK TO; the one after it does not.
        vec![
            q(vec![S::Begin]),
            q(vec![set("pl.a", "kept")]),
            q(vec![S::Savepoint("sp".into())]),
            q(vec![set("pl.b", "undone")]),
            q(vec![S::RollbackTo("sp".into())]),
            q(vec![S::Commit(false)]),
            Op::Failover,
        ],
        // PREPARE; DEALLOCATE; PREPARE replays one statement.
        vec![
            q(vec![S::Prepare("q".into())]),
            q(vec![S::Deallocate("q".into(), false)]),
            q(vec![S::Prepare("q".into())]),
            Op::Failover,
        ],
        // A PREPARE inside a rolled-back block is kept.
        vec![
            q(vec![S::Begin, S::Prepare("r".into()), S::Rollback]),
            Op::Failover,
        ],
        // set_config(..., false) is replayed, set_config(..., true) is not.
        vec![
            q(vec![S::Config("myapp.tenant".into(), "x".into(), false)]),
            q(vec![
                S::Begin,
                S::Config("myapp.user".into(), "u".into(), true),
                S::Commit(false),
            ]),
            Op::Failover,
        ],
        // COMMIT after a failover aborted the block fails (checked in `Run::op`), the
        // session then commits normally; also after a first statement already got 40001.
        vec![
            q(vec![S::Begin]),
            q(vec![set("pl.a", "lost")]),
            Op::Failover,
            q(vec![S::Commit(false)]),
            q(vec![S::Begin, set("pl.a", "after"), S::Commit(true)]),
        ],
        vec![
            q(vec![S::Begin]),
            Op::Failover,
            q(vec![set("pl.c", "x")]),
            q(vec![S::Commit(true)]),
        ],
        // RELEASE merges into the parent, which a ROLLBACK TO an outer savepoint undoes.
        vec![
            q(vec![S::Begin, S::Savepoint("a".into()), set("pl.a", "1")]),
            q(vec![
                S::Savepoint("b".into()),
                set("pl.b", "2"),
                S::Release("b".into()),
            ]),
            q(vec![
                S::RollbackTo("a".into()),
                set("pl.c", "3"),
                S::Commit(false),
            ]),
        ],
    ];
    for ops in cases {
        run(&ops);
    }
}
