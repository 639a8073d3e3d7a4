//! Group commit of grants: the grant attempts of one gateway that arrive
//! while its previous grant transaction is in flight go to etcd together,
//! in ONE transaction, instead of one round trip each.
//!
//! Each attempt keeps every condition it had alone: the shared transaction
//! is `If(offset unchanged) Then [sub-transaction per attempt]`, and each
//! sub-transaction is that attempt's own `If(g/KEY absent, no older waiter,
//! its waiter entry still queued) Then (put g/KEY on its own lease, put
//! f/KEY, drop its waiter entry)`: etcd evaluates every sub-transaction's
//! compares on its own, so one attempt failing (the key taken, an older
//! waiter) does not fail the others. A batch never holds two attempts of
//! the same key (the second waits for the next batch), so sub-transactions
//! never write the same key.
//!
//! Every grant of one transaction has the same etcd revision R; attempt i
//! of the batch (its *slot*, i < [`TOKEN_SLOTS`]) gets the token
//! `offset + R·TOKEN_SLOTS + i`, so a token still names exactly one grant
//! of one key, and tokens still increase strictly with etcd's history.
//! The slot is stored with the grant and the fence (`f/KEY` = `offset/i`),
//! so every gateway computes the same token from what it reads.
//!
//! This module must never answer an attempt with a grant it did not see
//! succeed in etcd; on an unknown outcome (an error, a timeout) every
//! attempt of the batch gets the error and revokes its own lease.

use std::collections::HashSet;
use std::sync::Arc;

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp, TxnOpResponse};
use tokio::sync::{mpsc, oneshot};

use super::mirror::GrantValue;
use super::{Cluster, TOKEN_SLOTS};
use crate::error::Error;

/// One grant attempt handed to the batcher.
pub(super) struct Attempt {
    pub key: String,
    /// Hash of the lease id, holder, granted TTL (ms): the grant's value
    /// without the offset and slot, which the batch fills in.
    pub secret: String,
    pub holder: String,
    pub granted_ms: u64,
    /// The attempt's own fresh etcd lease.
    pub lease: i64,
    /// This acquire's waiter entry and its create revision.
    pub queued: Option<(String, i64)>,
    pub reply: oneshot::Sender<Result<Option<Committed>, Error>>,
}

/// A grant committed in etcd by a batch.
#[derive(Debug, Clone, Copy)]
pub(super) struct Committed {
    pub revision: i64,
    pub slot: u64,
    pub offset: u64,
}

/// The queue in front of the batcher.
pub(super) type Queue = mpsc::UnboundedSender<Attempt>;

impl Cluster {
    /// Hands `attempt` to the batcher and waits for its outcome.
    pub(super) async fn grant_in_batch(
        &self,
        attempt: Attempt,
        rx: oneshot::Receiver<Result<Option<Committed>, Error>>,
    ) -> Result<Option<Committed>, Error> {
        if self.batches.send(attempt).is_err() {
            return Err(Error::Unavailable("this gateway is stopping".into()));
        }
        match rx.await {
            Ok(r) => r,
            Err(_) => Err(Error::Unavailable("etcd: granting: the batch ended without an answer".into())),
        }
    }

    /// The batcher: one grant transaction in flight; what queued meanwhile
    /// goes in the next one (up to [`TOKEN_SLOTS`] attempts).
    pub(super) async fn run_batches(self: Arc<Self>, mut rx: mpsc::UnboundedReceiver<Attempt>) {
        let mut carried: Vec<Attempt> = Vec::new();
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
            let mut batch: Vec<Attempt> = Vec::new();
            let mut keys = HashSet::new();
            let mut next = Vec::new();
            let mut take = |a: Attempt, batch: &mut Vec<Attempt>| {
                if batch.len() < slots && keys.insert(a.key.clone()) {
                    batch.push(a);
                } else {
                    // Same key as one in this batch, or the batch is full:
                    // the next batch, in arrival order.
                    next.push(a);
                }
            };
            for a in std::mem::take(&mut carried) {
                take(a, &mut batch);
            }
            while batch.len() < slots {
                let Ok(a) = rx.try_recv() else { break };
                take(a, &mut batch);
            }
            carried = next;
            self.commit(batch).await;
        }
    }

    /// One shared transaction for `batch`; answers every attempt.
    async fn commit(&self, batch: Vec<Attempt>) {
        let (offset, offset_rev) = {
            let m = self.lock_mirror();
            (m.offset, m.offset_rev)
        };
        let mut subs = Vec::with_capacity(batch.len());
        let mut live = Vec::with_capacity(batch.len());
        for (i, a) in batch.into_iter().enumerate() {
            let slot = u64::try_from(i).unwrap_or(u64::MAX);
            let value =
                GrantValue { s: a.secret.clone(), h: a.holder.clone(), t: a.granted_ms, o: offset, i: Some(slot) };
            let value = match serde_json::to_vec(&value) {
                Ok(v) => v,
                Err(e) => {
                    let _ = a.reply.send(Err(Error::Internal(format!("encoding a grant: {e}"))));
                    continue;
                }
            };
            let queue = self.keys.queue_prefix(&a.key);
            let queue_end = format!("{}\u{1}", queue.trim_end_matches('\0'));
            let grant_key = self.keys.grant(&a.key);
            let mut when = vec![Compare::create_revision(grant_key.clone(), CompareOp::Equal, 0)];
            let mut then = vec![
                TxnOp::put(grant_key, value, Some(PutOptions::new().with_lease(a.lease))),
                TxnOp::put(self.keys.fence(&a.key), format!("{offset}/{slot}"), None),
            ];
            match &a.queued {
                Some((qkey, rev)) => {
                    // Every waiter of the key is this one or younger …
                    when.push(
                        Compare::create_revision(queue.clone(), CompareOp::Greater, rev - 1).with_range(queue_end),
                    );
                    // … and this one is still queued (its gateway still a member).
                    when.push(Compare::create_revision(qkey.clone(), CompareOp::Equal, *rev));
                    then.push(TxnOp::delete(qkey.clone(), None));
                }
                None => when.push(Compare::create_revision(queue, CompareOp::Equal, 0).with_range(queue_end)),
            }
            subs.push(TxnOp::txn(Txn::new().when(when).and_then(then)));
            live.push((slot, a.reply));
        }
        if live.is_empty() {
            return;
        }
        let txn = Txn::new()
            .when(vec![Compare::mod_revision(self.keys.offset(), CompareOp::Equal, offset_rev)])
            .and_then(subs);
        let done = match super::call(self.timeout, "granting", || {
            let (mut kv, txn) = (self.client.kv_client(), txn.clone());
            async move { kv.txn(txn).await }
        })
        .await
        {
            Ok(d) => d,
            Err(e) => {
                let msg = match e {
                    Error::Unavailable(m) => m,
                    other => other.to_string(),
                };
                for (_, reply) in live {
                    let _ = reply.send(Err(Error::Unavailable(msg.clone())));
                }
                return;
            }
        };
        let revision = done.header().map_or(0, |h| h.revision());
        if !done.succeeded() {
            // The offset moved (raise-floor): nothing was granted, and the
            // key may well be free — not `locked`: try again.
            for (_, reply) in live {
                let _ = reply.send(Err(Error::Unavailable(
                    "the token offset moved while granting (`raise-floor` ran): nothing was granted; retry".into(),
                )));
            }
            return;
        }
        if crate::fault::enabled(crate::fault::Fault::SlowGrantAnswer) {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
        let outcomes = done.op_responses();
        for (n, (slot, reply)) in live.into_iter().enumerate() {
            let ok = matches!(outcomes.get(n), Some(TxnOpResponse::Txn(t)) if t.succeeded());
            let _ = reply.send(Ok(ok.then_some(Committed { revision, slot, offset })));
        }
    }
}
