//! One shutdown signal handed to every task: listeners stop accepting,
//! background loops end, in-flight requests drain up to a deadline.

use tokio::sync::watch;

/// Trigger side, held by whoever decides to stop (signals, tests).
#[derive(Debug, Clone)]
pub struct Trigger(watch::Sender<bool>);

/// Listening side, cloned into every task.
#[derive(Debug, Clone)]
pub struct Shutdown(watch::Receiver<bool>);

/// A new signal, not yet triggered.
pub fn channel() -> (Trigger, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (Trigger(tx), Shutdown(rx))
}

impl Trigger {
    /// Starts shutdown everywhere. Idempotent.
    pub fn trigger(&self) {
        self.0.send_replace(true);
    }
}

impl Shutdown {
    /// Resolves once shutdown was triggered (or its trigger was dropped).
    pub async fn wait(&self) {
        let mut rx = self.0.clone();
        // An error means every trigger is gone: nobody can start the
        // gateway's shutdown any more, so treat it as triggered.
        let _ = rx.wait_for(|stop| *stop).await;
    }

    /// True once shutdown was triggered.
    pub fn is_triggered(&self) -> bool {
        *self.0.borrow()
    }
}

/// Resolves on SIGTERM or Ctrl-C (SIGINT). The handlers are installed when
/// this is called, not when the future is first polled: a signal that
/// arrives in between (say, while the store opens) is kept and resolves the
/// future at once. Call inside the runtime.
pub fn os_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let term = signal(SignalKind::terminate()).ok();
        let int = signal(SignalKind::interrupt()).ok();
        async move {
            match (term, int) {
                (Some(mut term), Some(mut int)) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = int.recv() => {}
                    }
                }
                (Some(mut one), None) | (None, Some(mut one)) => {
                    let _ = one.recv().await;
                }
                (None, None) => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
