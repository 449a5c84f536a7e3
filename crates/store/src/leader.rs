//! Leadership among controllers that share one etcd: one leader at a time, by a lease.
//!
//! - Each candidate holds an etcd lease it keeps alive. To lead, it creates the `leader` key
//!   (under the cluster prefix) attached to that lease, in a transaction that succeeds only if
//!   the key is absent. The key's create revision is the leader's **term**: unique, and higher
//!   for every later leader (etcd revisions only grow).
//! - The leader stays leader while its lease lives. It counts its leadership valid only until
//!   `sent + ttl` of its last acknowledged keep-alive (`sent` = when that keep-alive left, so
//!   the lease can only expire after that instant, whatever the network did afterwards): past
//!   it, it must stop acting. [`Leadership::valid`] answers that.
//! - A standby waits on a watch of the key. The lease expiring (the leader's host died or was
//!   cut off) deletes the key and wakes it; a standby that has *proof* the leader's process is
//!   gone (its API refuses connections: nothing listens any more) revokes the leader's lease
//!   at once, which is the fast path (~tens of ms instead of the TTL).
//! - Writes of a leader can be fenced by its term ([`crate::EtcdStore::fence_writes`]): each
//!   write is then a transaction that also compares the leader key's create revision with the
//!   term, so a deposed leader's late write is refused by etcd itself
//!   ([`crate::StoreError::Deposed`]), not only by the replicas' own term checks.

use crate::etcd::{map_err, EtcdStore};
use crate::{Result, StoreError};
use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The key (under the cluster prefix) whose holder leads.
pub const LEADER_KEY: &str = "leader";

/// Who a candidate is, as the leader key's value shows it to the others.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Candidate {
    pub name: String,
    /// Where its API listens (TCP `host:port` or a unix path): standbys probe it, and a
    /// refused connection there is proof that the leader's process is gone.
    pub api: String,
}

/// The current leader.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leader {
    pub candidate: Candidate,
    pub term: u64,
    pub lease: i64,
}

/// What a waiting candidate sees each time it looks.
#[derive(Debug)]
pub enum Seen<'a> {
    /// Another candidate leads.
    Leader(&'a Leader),
    /// etcd did not answer (nobody can be elected meanwhile).
    Unavailable(&'a StoreError),
}

/// What a waiting candidate decided about the current leader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Keep waiting for its lease to end.
    Wait,
    /// Its process is gone for sure: revoke its lease now.
    Depose,
}

/// Held while leading. Dropping it stops the keep-alives (the lease then expires by itself);
/// [`EtcdStore::resign`] ends it at once.
pub struct Leadership {
    pub term: u64,
    pub lease: i64,
    keeper: Arc<Keeper>,
}

/// Shared between a [`Leadership`] and its keep-alive task.
struct Keeper {
    /// Leadership valid until this instant (nanoseconds since `epoch`).
    valid_until_ns: AtomicU64,
    epoch: Instant,
    /// The lease was reported gone (TTL 0) or revoked: leadership is over for good.
    lost: AtomicBool,
    stop: AtomicBool,
}

impl Keeper {
    fn new(valid_until: Instant) -> Keeper {
        let epoch = Instant::now();
        let k = Keeper {
            valid_until_ns: AtomicU64::new(0),
            epoch,
            lost: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        };
        k.extend(valid_until);
        k
    }
    fn extend(&self, until: Instant) {
        let ns = until.saturating_duration_since(self.epoch).as_nanos() as u64;
        self.valid_until_ns.fetch_max(ns, Ordering::AcqRel);
    }
    fn remaining(&self) -> Duration {
        if self.lost.load(Ordering::Acquire) {
            return Duration::ZERO;
        }
        let until = self.epoch + Duration::from_nanos(self.valid_until_ns.load(Ordering::Acquire));
        until.saturating_duration_since(Instant::now())
    }
}

impl Leadership {
    /// True while the lease surely lives (see the module doc). A leader must not act once false.
    pub fn valid(&self) -> bool {
        self.remaining() > Duration::ZERO
    }
    /// How long the leadership is surely valid from now.
    pub fn remaining(&self) -> Duration {
        self.keeper.remaining()
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.keeper.stop.store(true, Ordering::Release);
    }
}

/// A lease being kept alive (a candidate's, before and while it leads).
pub struct Lease {
    pub id: i64,
    pub ttl: Duration,
    keeper: Arc<Keeper>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        // A Leadership made from this lease shares the keeper; it stops it itself.
        if Arc::strong_count(&self.keeper) == 2 {
            self.keeper.stop.store(true, Ordering::Release);
        }
    }
}

impl EtcdStore {
    fn leader_full_key(&self) -> String {
        format!("{}{LEADER_KEY}", self.prefix())
    }

    /// Grants a lease of `ttl` (etcd rounds it up to its minimum, 2 s by default; whole
    /// seconds) and keeps it alive in the background until dropped.
    pub fn grant_lease(&self, ttl: Duration) -> Result<Lease> {
        let secs = ttl.as_secs().max(1) as i64;
        let sent = Instant::now();
        let resp = self.call(|mut c| async move { c.lease_grant(secs, None).await })?;
        let granted = Duration::from_secs(resp.ttl().max(1) as u64);
        let keeper = Arc::new(Keeper::new(sent + granted));
        self.spawn(keep_alive(
            self.client(),
            resp.id(),
            granted,
            keeper.clone(),
        ));
        Ok(Lease {
            id: resp.id(),
            ttl: granted,
            keeper,
        })
    }

    /// The current leader, if any.
    pub fn leader(&self) -> Result<Option<Leader>> {
        let full = self.leader_full_key();
        let resp = self.call(|mut c| async move { c.get(full, None).await })?;
        let Some(kv) = resp.kvs().first() else {
            return Ok(None);
        };
        let candidate: Candidate =
            serde_json::from_slice(kv.value()).map_err(|e| StoreError::Decode {
                key: LEADER_KEY.into(),
                reason: e.to_string(),
            })?;
        Ok(Some(Leader {
            candidate,
            term: kv.create_revision().max(0) as u64,
            lease: kv.lease(),
        }))
    }

    /// One attempt to lead under `lease`: `Ok(Ok(leadership))`, or `Ok(Err(leader))` naming
    /// who leads now.
    pub fn try_lead(
        &self,
        me: &Candidate,
        lease: &Lease,
    ) -> Result<std::result::Result<Leadership, Leader>> {
        let full = self.leader_full_key();
        let value = serde_json::to_string(me).map_err(|e| StoreError::Decode {
            key: LEADER_KEY.into(),
            reason: e.to_string(),
        })?;
        let opts = etcd_client::PutOptions::new().with_lease(lease.id);
        let txn = Txn::new()
            .when(vec![Compare::create_revision(
                full.clone(),
                CompareOp::Equal,
                0,
            )])
            .and_then(vec![TxnOp::put(full.clone(), value, Some(opts))])
            .or_else(vec![TxnOp::get(full, None)]);
        let resp = self.call(|mut c| async move { c.txn(txn).await })?;
        if resp.succeeded() {
            let term = resp.header().map_or(0, |h| h.revision().max(0) as u64);
            return Ok(Ok(Leadership {
                term,
                lease: lease.id,
                keeper: lease.keeper.clone(),
            }));
        }
        for r in resp.op_responses() {
            if let TxnOpResponse::Get(g) = r {
                if let Some(kv) = g.kvs().first() {
                    let candidate =
                        serde_json::from_slice(kv.value()).map_err(|e| StoreError::Decode {
                            key: LEADER_KEY.into(),
                            reason: e.to_string(),
                        })?;
                    return Ok(Err(Leader {
                        candidate,
                        term: kv.create_revision().max(0) as u64,
                        lease: kv.lease(),
                    }));
                }
            }
        }
        // Deleted between the comparison and the read: the caller simply tries again.
        Err(StoreError::Backend {
            backend: "etcd",
            reason: "leader key vanished during the election; retry".into(),
        })
    }

    /// Waits until this candidate leads. While another leads, `observe` is told about it every
    /// `poll` (a standby probes the leader there); `Verdict::Depose` revokes that leader's
    /// lease. `stop` ends the wait (`Ok(None)`). etcd being unreachable is retried (and told
    /// to `observe` as [`Seen::Unavailable`]): a candidate that cannot reach etcd cannot lead,
    /// and waits.
    pub fn campaign(
        &self,
        me: &Candidate,
        ttl: Duration,
        poll: Duration,
        stop: &AtomicBool,
        mut observe: impl FnMut(Seen<'_>) -> Verdict,
    ) -> Result<Option<Leadership>> {
        let mut lease: Option<Lease> = None;
        while !stop.load(Ordering::Relaxed) {
            let l = match lease.take() {
                // A lease whose keep-alives failed past its TTL is gone: take a new one.
                Some(l) if l.keeper.remaining() > Duration::ZERO => l,
                _ => match self.grant_lease(ttl) {
                    Ok(l) => l,
                    Err(e @ StoreError::Unavailable { .. }) => {
                        observe(Seen::Unavailable(&e));
                        std::thread::sleep(poll);
                        continue;
                    }
                    Err(e) => return Err(e),
                },
            };
            match self.try_lead(me, &l) {
                Ok(Ok(leadership)) => return Ok(Some(leadership)),
                Ok(Err(leader)) => {
                    if observe(Seen::Leader(&leader)) == Verdict::Depose {
                        // Revoking a lease that already ended is not an error worth stopping.
                        let _ = self.revoke(leader.lease);
                        lease = Some(l);
                        continue;
                    }
                }
                Err(e @ StoreError::Unavailable { .. }) => {
                    observe(Seen::Unavailable(&e));
                }
                Err(StoreError::Backend { .. }) => {}
                Err(e) => return Err(e),
            }
            lease = Some(l);
            std::thread::sleep(poll);
        }
        Ok(None)
    }

    /// Revokes a lease: every key attached to it is deleted now.
    pub fn revoke(&self, lease: i64) -> Result<()> {
        self.call(|mut c| async move { c.lease_revoke(lease).await })
            .map(|_| ())
    }

    /// Ends a leadership now (the leader key goes with its lease).
    pub fn resign(&self, l: Leadership) -> Result<()> {
        l.keeper.lost.store(true, Ordering::Release);
        self.revoke(l.lease)
    }
}

/// Keeps `lease` alive every third of its TTL and extends the keeper's validity to
/// `sent + ttl` of each acknowledged keep-alive. A TTL of 0 in an answer means the lease is
/// gone (expired or revoked): lost for good.
async fn keep_alive(client: etcd_client::Client, lease: i64, ttl: Duration, k: Arc<Keeper>) {
    let every = (ttl / 3).max(Duration::from_millis(100));
    let mut stream: Option<(etcd_client::LeaseKeeper, etcd_client::LeaseKeepAliveStream)> = None;
    while !k.stop.load(Ordering::Acquire) && !k.lost.load(Ordering::Acquire) {
        let sent = Instant::now();
        if stream.is_none() {
            let mut c = client.clone();
            match tokio::time::timeout(every, c.lease_keep_alive(lease)).await {
                // Opening the stream sends the first keep-alive and reads its answer.
                Ok(Ok(s)) => {
                    k.extend(sent + ttl);
                    stream = Some(s);
                }
                Ok(Err(etcd_client::Error::LeaseKeepAliveError(_))) => {
                    k.lost.store(true, Ordering::Release);
                    return;
                }
                _ => {}
            }
        } else if let Some((keeper, s)) = stream.as_mut() {
            let answered = async {
                keeper.keep_alive().await.map_err(map_err)?;
                s.message().await.map_err(map_err)
            };
            match tokio::time::timeout(every, answered).await {
                Ok(Ok(Some(resp))) if resp.ttl() > 0 => k.extend(sent + ttl),
                Ok(Ok(Some(_))) => {
                    k.lost.store(true, Ordering::Release);
                    return;
                }
                // Broken or silent stream: reopen it next round.
                _ => stream = None,
            }
        }
        let spent = sent.elapsed();
        tokio::time::sleep(every.saturating_sub(spent)).await;
    }
}
