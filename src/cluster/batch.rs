//! Group commit: every grant, renewal, release and expiry of one gateway
//! that arrives while its previous transaction is in flight goes to etcd
//! together, in ONE transaction, instead of one round trip each.
//!
//! Each operation keeps every condition it had alone: the shared
//! transaction is `Then [one sub-transaction per operation]` with no
//! compare of its own, and etcd evaluates each sub-transaction's compares
//! on its own, so one failing (a key taken, a renewal of a grant that
//! ended) does not fail the others:
//!
//! - a grant: `If(offset unchanged) Then [If(g/KEY absent, no older
//!   waiter, its waiter entry still queued) Then (put g/KEY, put f/KEY,
//!   drop its waiter entry)]` (the outer level tells "the offset moved"
//!   from "the key is taken");
//! - a renewal: `If(create_revision(g/KEY) = R) Then put g/KEY` (the same
//!   value; the put moves its `mod_revision`, which restarts every
//!   gateway's expiry deadline);
//! - an end (release, or a grant made for an acquire that hung up):
//!   `If(create_revision(g/KEY) = R) Then delete g/KEY`, or, when the
//!   grant's revision is unknown (its transaction's outcome was), `If(value
//!   = the grant's value, which holds its random lease-id hash) Then delete`;
//! - an expiry: `If(mod_revision(g/KEY) = M) Then delete g/KEY`;
//! - this gateway's acknowledgement (`feed.rs`): `If(lease(m/GW) = its
//!   member lease) Then put a/GW` — written here, with the grants,
//!   renewals and releases that go out at the same moment, rather than in
//!   a transaction of its own (the compare keeps an ended membership from
//!   failing the whole transaction: a put on a lease etcd no longer has
//!   would).
//!
//! A transaction never holds two operations of the same key (the second
//! waits for the next one), so sub-transactions never write the same key.
//!
//! Every grant of one transaction has the same etcd revision R; grant i of
//! the transaction (its *slot*, i < [`TOKEN_SLOTS`]) gets the token
//! `offset + R·TOKEN_SLOTS + i`, so a token still names exactly one grant
//! of one key, and tokens still increase strictly with etcd's history.
//! The slot is stored with the grant and the fence (`f/KEY` = `offset/i`),
//! so every gateway computes the same token from what it reads.
//!
//! This module must never answer an operation with an outcome it did not
//! see in etcd; on an unknown outcome (an error, a timeout) every operation
//! gets the error, and every grant of the transaction is ended by value
//! (a grant made for nobody would otherwise live its TTL).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};
use tokio::sync::{mpsc, oneshot};

use super::mirror::GrantValue;
use super::{Cluster, TOKEN_SLOTS};
use crate::error::Error;

/// Sub-transactions per shared transaction. etcd (`--max-txn-ops`, 128 by
/// default) also limits a nested transaction to 128 minus the ops around
/// it, so this leaves room for a grant's nested compares and writes.
const MAX_OPS: usize = 96;

/// One grant attempt handed to the batcher.
pub(super) struct Attempt {
    pub key: String,
    /// Hash of the lease id, holder, granted TTL (ms): the grant's value
    /// without the offset and slot, which the batch fills in.
    pub secret: String,
    pub holder: String,
    pub granted_ms: u64,
    /// This acquire's waiter entry and its create revision.
    pub queued: Option<(String, i64)>,
    /// Shared with the acquire: who ends the grant if it is never answered.
    pub orphan: Orphan,
    pub reply: oneshot::Sender<Result<Granting, Error>>,
}

/// What became of a grant attempt in its shared transaction.
#[derive(Debug)]
pub(super) enum Granting {
    Committed(Committed),
    /// The key is held, or an older waiter is queued.
    Taken,
    /// The token offset moved (`raise-floor` ran) since the batch read it
    /// at this mod revision: nothing was granted, and the key may well be
    /// free.
    OffsetMoved(i64),
}

/// A grant committed in etcd by a batch.
#[derive(Debug, Clone)]
pub(super) struct Committed {
    pub revision: i64,
    pub slot: u64,
    pub offset: u64,
    /// The grant's value as written (a renewal puts it again).
    pub value: Vec<u8>,
}

/// One operation of a shared transaction.
pub(super) enum Op {
    Grant(Attempt),
    /// Puts `g/KEY` again (`value`) if it is still the grant created at
    /// `created`; answers whether it was.
    Renew {
        key: String,
        created: i64,
        value: Vec<u8>,
        reply: oneshot::Sender<Result<bool, Error>>,
    },
    /// Deletes `g/KEY` if it is still the grant created at `created`;
    /// answers whether it was.
    End {
        key: String,
        created: i64,
        reply: Option<oneshot::Sender<Result<bool, Error>>>,
    },
    /// Deletes `g/KEY` if its value is still `value` (the value holds the
    /// grant's random lease-id hash: no other grant, in any history, has
    /// it); answers whether it was, if asked.
    EndByValue {
        key: String,
        value: Vec<u8>,
        reply: Option<oneshot::Sender<Result<bool, Error>>>,
    },
    /// Deletes `g/KEY` if its last put is still `modified`.
    Expire {
        key: String,
        modified: i64,
        reply: oneshot::Sender<Result<bool, Error>>,
    },
    /// Puts this gateway's acknowledgement `a/GW` (its value computed when
    /// the transaction is built); answers whether it was written.
    Ack {
        reply: oneshot::Sender<Result<bool, Error>>,
    },
}

/// What stands for the acknowledgement among a batch's keys (no lock key
/// is empty, `validate_key`): one per transaction.
const ACK_SLOT: &str = "";

impl Op {
    fn key(&self) -> &str {
        match self {
            Op::Grant(a) => &a.key,
            Op::Renew { key, .. } | Op::End { key, .. } | Op::EndByValue { key, .. } | Op::Expire { key, .. } => key,
            Op::Ack { .. } => ACK_SLOT,
        }
    }
}

/// The queue in front of the batcher.
pub(super) type Queue = mpsc::UnboundedSender<Op>;

/// Who ends a committed grant that is never answered: the acquire (once it
/// holds the grant's revision, on every path that does not answer it, a
/// dropped acquire included) or the batch (when the acquire was dropped
/// before the batch could hand it the revision). One mutex, so exactly one
/// of them does.
#[derive(Debug, Clone, Default)]
pub(super) struct Orphan(Arc<Mutex<OrphanState>>);

#[derive(Debug, Default)]
struct OrphanState {
    /// The acquire is gone.
    dropped: bool,
    /// The committed, unanswered grant: its key and create revision.
    grant: Option<(String, i64)>,
}

impl Orphan {
    fn lock(&self) -> std::sync::MutexGuard<'_, OrphanState> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The batch committed the grant: handed to the acquire, or ended at
    /// once if the acquire is gone.
    fn committed(&self, queue: &Queue, key: &str, created: i64) {
        let mut s = self.lock();
        if s.dropped {
            let _ = queue.send(Op::End { key: key.to_string(), created, reply: None });
        } else {
            s.grant = Some((key.to_string(), created));
        }
    }

    /// The acquire answered its client: nothing to end.
    pub(super) fn answered(&self) {
        self.lock().grant = None;
    }

    /// The acquire ends without answering (dropped included): ends the
    /// grant if the batch already handed it over.
    pub(super) fn abandon(&self, queue: &Queue) {
        let mut s = self.lock();
        s.dropped = true;
        if let Some((key, created)) = s.grant.take() {
            let _ = queue.send(Op::End { key, created, reply: None });
        }
    }
}

/// How to read one sub-transaction's outcome.
enum Pending {
    Grant {
        slot: u64,
        key: String,
        value: Vec<u8>,
        orphan: Orphan,
        reply: oneshot::Sender<Result<Granting, Error>>,
    },
    Answer(oneshot::Sender<Result<bool, Error>>),
    /// The acknowledgement, and the value it puts.
    Ack(i64, oneshot::Sender<Result<bool, Error>>),
    Silent,
}

impl Cluster {
    /// Hands `attempt` to the batcher and waits for its outcome.
    pub(super) async fn grant_in_batch(
        &self,
        attempt: Attempt,
        rx: oneshot::Receiver<Result<Granting, Error>>,
    ) -> Result<Granting, Error> {
        if self.batches.send(Op::Grant(attempt)).is_err() {
            return Err(Error::Unavailable("this gateway is stopping".into()));
        }
        match rx.await {
            Ok(r) => r,
            Err(_) => Err(Error::Unavailable("etcd: granting: the batch ended without an answer".into())),
        }
    }

    /// Sends `op` (built around `reply`) to the batcher; its outcome.
    pub(super) async fn in_batch(&self, op: Op, rx: oneshot::Receiver<Result<bool, Error>>) -> Result<bool, Error> {
        if self.batches.send(op).is_err() {
            return Err(Error::Unavailable("this gateway is stopping".into()));
        }
        match rx.await {
            Ok(r) => r,
            Err(_) => Err(Error::Unavailable("etcd: the shared transaction ended without an answer".into())),
        }
    }

    /// Renews the grant of `key` created at `created` (puts `value`
    /// again): `Ok(false)` when it has ended.
    pub(super) async fn renew_grant(&self, key: &str, created: i64, value: Vec<u8>) -> Result<bool, Error> {
        let (reply, rx) = oneshot::channel();
        self.in_batch(Op::Renew { key: key.to_string(), created, value, reply }, rx).await
    }

    /// Ends the grant of `key` created at `created`: `Ok(false)` when it
    /// had already ended.
    pub(super) async fn end_grant(&self, key: &str, created: i64) -> Result<bool, Error> {
        let (reply, rx) = oneshot::channel();
        self.in_batch(Op::End { key: key.to_string(), created, reply: Some(reply) }, rx).await
    }

    /// Writes this gateway's acknowledgement in the next shared
    /// transaction: `Ok(true)` when it is written (or nothing was left to
    /// write).
    pub(super) async fn ack_in_batch(&self) -> Result<bool, Error> {
        let (reply, rx) = oneshot::channel();
        self.in_batch(Op::Ack { reply }, rx).await
    }

    /// Ends the grant of `key` whose value is `value` (its lease-id hash
    /// makes it that very grant): `Ok(false)` when it had already ended.
    pub(super) async fn end_grant_by_value(&self, key: &str, value: Vec<u8>) -> Result<bool, Error> {
        let (reply, rx) = oneshot::channel();
        self.in_batch(Op::EndByValue { key: key.to_string(), value, reply: Some(reply) }, rx).await
    }

    /// The batcher: one shared transaction in flight; what queued
    /// meanwhile goes in the next one (up to [`TOKEN_SLOTS`] grants and
    /// [`MAX_OPS`] operations, one per key).
    pub(super) async fn run_batches(self: Arc<Self>, mut rx: mpsc::UnboundedReceiver<Op>) {
        let mut carried: Vec<Op> = Vec::new();
        loop {
            if carried.is_empty() {
                tokio::select! {
                    a = rx.recv() => match a {
                        Some(a) => carried.push(a),
                        None => return,
                    },
                    () = self.stop.wait() => return,
                }
            }
            let slots = usize::try_from(TOKEN_SLOTS).unwrap_or(usize::MAX);
            let mut batch: Vec<Op> = Vec::new();
            let mut grants = 0usize;
            let mut keys = HashSet::new();
            let mut next = Vec::new();
            let mut take = |op: Op, batch: &mut Vec<Op>| {
                let grant = matches!(op, Op::Grant(_));
                let room = batch.len() < MAX_OPS && (!grant || grants < slots);
                if room && keys.insert(op.key().to_string()) {
                    grants += usize::from(grant);
                    batch.push(op);
                } else {
                    // Same key as one in this batch, or the batch is full:
                    // the next batch, in arrival order.
                    next.push(op);
                }
            };
            for op in std::mem::take(&mut carried) {
                take(op, &mut batch);
            }
            while batch.len() < MAX_OPS {
                let Ok(op) = rx.try_recv() else { break };
                take(op, &mut batch);
            }
            carried = next;
            self.batching.store(true, std::sync::atomic::Ordering::Release);
            self.commit(batch).await;
            self.batching.store(false, std::sync::atomic::Ordering::Release);
        }
    }

    /// One grant's sub-transaction, or why it cannot be written.
    fn grant_op(&self, a: &Attempt, offset: u64, offset_rev: i64, slot: u64) -> Result<(TxnOp, Vec<u8>), Error> {
        let value = GrantValue { s: a.secret.clone(), h: a.holder.clone(), t: a.granted_ms, o: offset, i: Some(slot) };
        let value = serde_json::to_vec(&value).map_err(|e| Error::Internal(format!("encoding a grant: {e}")))?;
        let queue = self.keys.queue_prefix(&a.key);
        let queue_end = format!("{}\u{1}", queue.trim_end_matches('\0'));
        let grant_key = self.keys.grant(&a.key);
        let mut when = vec![Compare::create_revision(grant_key.clone(), CompareOp::Equal, 0)];
        let mut then = vec![
            TxnOp::put(grant_key, value.clone(), None),
            TxnOp::put(self.keys.fence(&a.key), format!("{offset}/{slot}"), None),
        ];
        match &a.queued {
            Some((qkey, rev)) => {
                // Every waiter of the key is this one or younger …
                when.push(Compare::create_revision(queue.clone(), CompareOp::Greater, rev - 1).with_range(queue_end));
                // … and this one is still queued (its gateway still a member).
                when.push(Compare::create_revision(qkey.clone(), CompareOp::Equal, *rev));
                then.push(TxnOp::delete(qkey.clone(), None));
            }
            None => when.push(Compare::create_revision(queue, CompareOp::Equal, 0).with_range(queue_end)),
        }
        let inner = TxnOp::txn(Txn::new().when(when).and_then(then));
        let outer = Txn::new()
            .when(vec![Compare::mod_revision(self.keys.offset(), CompareOp::Equal, offset_rev)])
            .and_then(vec![inner]);
        Ok((TxnOp::txn(outer), value))
    }

    /// One shared transaction for `batch`; answers every operation.
    async fn commit(&self, batch: Vec<Op>) {
        let (offset, offset_rev) = {
            let m = self.lock_mirror();
            (m.offset, m.offset_rev)
        };
        let mut subs = Vec::with_capacity(batch.len());
        let mut pending = Vec::with_capacity(batch.len());
        let mut slot = 0u64;
        let mut renewals = 0usize;
        // Held until the transaction's outcome is known: acknowledgements
        // only go up, one write at a time (`write_ack`).
        let mut acked = None;
        for op in batch {
            match op {
                Op::Ack { reply } => {
                    let last = self.ack_lock.lock().await;
                    match self.ack_to_write(*last) {
                        Ok((target, _)) if target == *last => {
                            let _ = reply.send(Ok(true));
                        }
                        Ok((target, lease)) => {
                            let m = self.keys.member(&self.gateway_id);
                            let put = TxnOp::put(
                                self.keys.ack(&self.gateway_id),
                                target.to_string(),
                                Some(PutOptions::new().with_lease(lease)),
                            );
                            let when = vec![Compare::lease(m, CompareOp::Equal, lease)];
                            subs.push(TxnOp::txn(Txn::new().when(when).and_then(vec![put])));
                            pending.push(Pending::Ack(target, reply));
                            acked = Some(last);
                        }
                        Err(e) => {
                            let _ = reply.send(Err(e));
                        }
                    }
                }
                Op::Grant(a) => match self.grant_op(&a, offset, offset_rev, slot) {
                    Ok((sub, value)) => {
                        subs.push(sub);
                        pending.push(Pending::Grant { slot, key: a.key, value, orphan: a.orphan, reply: a.reply });
                        slot += 1;
                    }
                    Err(e) => {
                        let _ = a.reply.send(Err(e));
                    }
                },
                Op::Renew { key, created, value, reply } => {
                    let g = self.keys.grant(&key);
                    let when = vec![Compare::create_revision(g.clone(), CompareOp::Equal, created)];
                    subs.push(TxnOp::txn(Txn::new().when(when).and_then(vec![TxnOp::put(g, value, None)])));
                    pending.push(Pending::Answer(reply));
                    renewals += 1;
                }
                Op::End { key, created, reply } => {
                    let g = self.keys.grant(&key);
                    let when = vec![Compare::create_revision(g.clone(), CompareOp::Equal, created)];
                    subs.push(TxnOp::txn(Txn::new().when(when).and_then(vec![TxnOp::delete(g, None)])));
                    pending.push(reply.map_or(Pending::Silent, Pending::Answer));
                }
                Op::EndByValue { key, value, reply } => {
                    let g = self.keys.grant(&key);
                    let when = vec![Compare::value(g.clone(), CompareOp::Equal, value)];
                    subs.push(TxnOp::txn(Txn::new().when(when).and_then(vec![TxnOp::delete(g, None)])));
                    pending.push(reply.map_or(Pending::Silent, Pending::Answer));
                }
                Op::Expire { key, modified, reply } => {
                    let g = self.keys.grant(&key);
                    let when = vec![Compare::mod_revision(g.clone(), CompareOp::Equal, modified)];
                    subs.push(TxnOp::txn(Txn::new().when(when).and_then(vec![TxnOp::delete(g, None)])));
                    pending.push(Pending::Answer(reply));
                }
            }
        }
        if pending.is_empty() {
            return;
        }
        let txn = Txn::new().and_then(subs);
        let done = match self.etcd.txn(self.timeout, "a shared transaction", txn).await {
            Ok(d) => d,
            Err(e) => {
                let msg = match e {
                    Error::Unavailable(m) => m,
                    other => other.to_string(),
                };
                for p in pending {
                    match p {
                        Pending::Grant { key, value, reply, .. } => {
                            // Unknown outcome: a grant it may have made is
                            // ended by its value (unique: the lease-id hash).
                            let _ = self.batches.send(Op::EndByValue { key, value, reply: None });
                            let _ = reply.send(Err(Error::Unavailable(msg.clone())));
                        }
                        Pending::Answer(reply) | Pending::Ack(_, reply) => {
                            let _ = reply.send(Err(Error::Unavailable(msg.clone())));
                        }
                        Pending::Silent => {}
                    }
                }
                return;
            }
        };
        let revision = done.header().map_or(0, |h| h.revision());
        if crate::fault::enabled(crate::fault::Fault::SlowGrantAnswer) && (slot > 0 || renewals > 0) {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
        let outcomes = done.op_responses();
        for (n, p) in pending.into_iter().enumerate() {
            let sub = match outcomes.get(n) {
                Some(TxnOpResponse::Txn(t)) => Some(t),
                _ => None,
            };
            let ok = sub.is_some_and(|t| t.succeeded());
            match p {
                Pending::Grant { slot, key, value, orphan, reply } => {
                    if !ok {
                        // The offset moved (raise-floor): nothing was
                        // granted, and the key may well be free — not
                        // `locked`: the acquire tries again.
                        let _ = reply.send(Ok(Granting::OffsetMoved(offset_rev)));
                        continue;
                    }
                    let inner = sub.and_then(|t| match t.op_responses().first() {
                        Some(TxnOpResponse::Txn(i)) => Some(i.succeeded()),
                        _ => None,
                    });
                    if inner == Some(true) {
                        orphan.committed(&self.batches, &key, revision);
                        let _ = reply.send(Ok(Granting::Committed(Committed { revision, slot, offset, value })));
                    } else {
                        let _ = reply.send(Ok(Granting::Taken));
                    }
                }
                Pending::Answer(reply) => {
                    let _ = reply.send(Ok(ok));
                }
                Pending::Ack(target, reply) => {
                    if let Some(last) = acked.as_mut().filter(|_| ok) {
                        **last = target;
                    }
                    let _ = reply.send(Ok(ok));
                }
                Pending::Silent => {}
            }
        }
    }
}
