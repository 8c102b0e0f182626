//! Drain: the calls a host is running, and its stopping.
//!
//! Rule: **once the host is stopping, no call starts; the stop waits for the calls
//! already running** ([`Calls::drain`], at most [`crate::shutdown::DRAIN_TIMEOUT`] in
//! [`crate::shutdown`]) before the connections are stopped ([`Live::shutdown`], which
//! also marks the host as stopping, so nothing is restarted). A call counts from [`Calls::started`] until its
//! [`InFlight`] guard drops; a call that starts after [`Calls::begin_shutdown`] gets no
//! guard and must be refused. The count is raised before the stopping flag is read, so
//! a call racing the shutdown is either refused or waited for, never neither.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use super::live::Live;

/// The calls in flight and whether the host is stopping. Fresh: no call, not stopping.
#[derive(Default)]
pub struct Calls {
    /// Set once the host stops: new calls are refused, nothing is restarted.
    closing: AtomicBool,
    /// Calls being run now.
    in_flight: AtomicUsize,
    /// Woken when `in_flight` drops to zero.
    drained: tokio::sync::Notify,
}

/// A call being run (see [`Calls::started`]); dropping it ends the count.
pub struct InFlight<'a>(&'a Calls);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.0.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.drained.notify_waiters();
        }
    }
}

impl Calls {
    /// Counts a call as running until the guard drops; `None` once the host is stopping
    /// (the call must be refused).
    pub fn started(&self) -> Option<InFlight<'_>> {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        let guard = InFlight(self);
        (!self.is_closing()).then_some(guard)
    }

    /// Calls running now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// True once the host is stopping.
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Marks the host as stopping: new calls are refused.
    pub fn begin_shutdown(&self) {
        self.closing.store(true, Ordering::Release);
    }

    /// Waits until no call runs, at most `limit`. Returns false when calls still ran.
    pub async fn drain(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let drained = self.drained.notified();
            if self.in_flight() == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, drained).await.is_err() {
                return self.in_flight() == 0;
            }
        }
    }
}

impl Live {
    /// Counts a call as running until the guard drops; `None` once the host is stopping
    /// (the call must be refused). See [`Calls::started`].
    pub fn call_started(&self) -> Option<InFlight<'_>> {
        self.calls.started()
    }

    /// Calls running now.
    pub fn calls_in_flight(&self) -> usize {
        self.calls.in_flight()
    }

    /// True once the host is stopping.
    pub fn is_closing(&self) -> bool {
        self.calls.is_closing()
    }

    /// Marks the host as stopping: new calls are refused, no connection is restarted.
    pub fn begin_shutdown(&self) {
        self.calls.begin_shutdown();
    }

    /// Waits until no call runs, at most `limit`. Returns false when calls still ran.
    pub async fn drain(&self, limit: Duration) -> bool {
        self.calls.drain(limit).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call started before the host stops is counted and waited for; one started after
    /// is refused and leaves the count as it was.
    #[tokio::test]
    async fn once_stopping_no_call_starts_and_the_running_ones_are_waited_for() {
        let calls = Calls::default();
        let running = calls.started().expect("the host is not stopping");
        assert_eq!(calls.in_flight(), 1);
        calls.begin_shutdown();
        assert!(calls.is_closing());
        assert!(calls.started().is_none(), "refused once stopping");
        assert_eq!(calls.in_flight(), 1, "a refused call is not counted");
        let (drained, ()) = tokio::join!(calls.drain(Duration::from_secs(30)), async {
            tokio::task::yield_now().await;
            drop(running);
        });
        assert!(drained, "the drain ends when the last call does");
        assert_eq!(calls.in_flight(), 0);
    }

    /// A call that does not end within the limit leaves the drain false (the caller
    /// stops anyway); with nothing running it is true at once.
    #[tokio::test]
    async fn a_call_outliving_the_limit_leaves_the_drain_unfinished() {
        let calls = Calls::default();
        assert!(calls.drain(Duration::ZERO).await, "nothing runs");
        let _running = calls.started().unwrap();
        let _other = calls.started().unwrap();
        assert!(!calls.drain(Duration::from_millis(20)).await);
        assert_eq!(calls.in_flight(), 2);
    }

    /// Guards end their own count only: the drain waits for the last of several.
    #[tokio::test]
    async fn the_drain_waits_for_the_last_of_several_calls() {
        let calls = std::sync::Arc::new(Calls::default());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let first = calls.started().unwrap();
        let c = calls.clone();
        let second = tokio::spawn(async move {
            let _guard = c.started().unwrap();
            let _ = rx.await;
        });
        while calls.in_flight() < 2 {
            tokio::task::yield_now().await;
        }
        drop(first);
        assert_eq!(calls.in_flight(), 1);
        assert!(
            !calls.drain(Duration::from_millis(1)).await,
            "one still runs"
        );
        tx.send(()).unwrap();
        assert!(calls.drain(Duration::from_secs(30)).await);
        second.await.unwrap();
    }
}
