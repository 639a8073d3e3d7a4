//! What the kernel still holds of what was written to an upstream
//! connection, and how to make it drop that.
//!
//! A write returns once its bytes are in the gateway's own send queue: an
//! upstream that reads slowly (or answers on the head and stops reading)
//! can receive them much later, after a newer holder's write. A fenced
//! request therefore counts as sent only once the upstream's kernel has
//! acknowledged every byte of it ([`delivered`]); until then it stays in
//! flight, and giving it up resets the connection ([`reset`]), which drops
//! the queue instead of sending it on as a close (FIN) would.

use std::os::fd::AsFd;

/// True when every byte written to `tcp` has been acknowledged by the
/// peer's kernel: nothing unsent, nothing in flight. False when that
/// cannot be read (then the caller treats the bytes as not delivered).
pub fn delivered(tcp: impl AsFd) -> bool {
    match tcp_info_sys::get_tcp_info(tcp.as_fd()) {
        Ok(info) => info.tcpi_notsent_bytes == 0 && info.tcpi_unacked == 0,
        Err(_) => false,
    }
}

/// Makes every close of `tcp` a reset (zero linger) — above all the one
/// the kernel does when the process dies (`kill -9`, a crash): a dead
/// gateway's sockets would otherwise close with a FIN and the kernel would
/// go on delivering their send queues for minutes, to an upstream that
/// reads late, long after the dead gateway's quarantine let a newer holder
/// write. A connection whose every request was delivered is closed
/// cleanly by [`close_cleanly`] where the gateway itself ends it; idle
/// connections ended otherwise are reset, as HAProxy's `option nolinger`
/// does.
///
/// A gateway that cannot reset anything — paused (`SIGSTOP`, a VM
/// stall), or alive but cut from an upstream that does not read — leaves
/// its queue to the kernel, which would retransmit it, or probe a zero
/// window, for many minutes. `TCP_USER_TIMEOUT` = `stall_limit` (the
/// route's upstream timeout) makes the kernel give the connection up
/// instead once bytes have waited that long unacknowledged or behind a
/// closed window, well inside the quarantine a paused gateway's peers
/// wait out (its membership TTL, then the upstream timeout).
pub fn abort_on_exit(tcp: impl AsFd, stall_limit: std::time::Duration) -> std::io::Result<()> {
    let fd = tcp.as_fd();
    rustix::net::sockopt::set_socket_linger(fd, Some(std::time::Duration::ZERO))?;
    let ms = u32::try_from(stall_limit.as_millis()).unwrap_or(u32::MAX).max(1);
    rustix::net::sockopt::set_tcp_user_timeout(fd, ms)?;
    Ok(())
}

/// Lets a close of `tcp` be a clean one (FIN) again: everything written
/// on it was delivered.
pub fn close_cleanly(tcp: impl AsFd) {
    let _ = rustix::net::sockopt::set_socket_linger(tcp.as_fd(), None);
}

/// Resets the connection now: the kernel drops what it has not delivered
/// and sends a RST; the descriptor stays open (reads and writes on it
/// fail). `connect(AF_UNSPEC)` on a TCP socket is the RFC 793 ABORT; where
/// it fails, zero linger makes the eventual close a reset instead.
pub fn reset(tcp: impl AsFd) {
    let fd = tcp.as_fd();
    if rustix::net::connect_unspec(fd).is_err() {
        let _ = rustix::net::sockopt::set_socket_linger(fd, Some(std::time::Duration::ZERO));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    /// A peer whose receive buffer is small: what it does not read stays
    /// in the writer's send queue.
    async fn pair() -> (TcpStream, TcpStream) {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener: TcpListener = socket.listen(1).unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (client.unwrap(), accepted.unwrap().0)
    }

    async fn delivered_within(tcp: &TcpStream, within: Duration) -> bool {
        let until = tokio::time::Instant::now() + within;
        while tokio::time::Instant::now() < until {
            if delivered(tcp) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        false
    }

    #[tokio::test]
    async fn bytes_the_peer_has_not_taken_are_not_delivered_and_a_reset_drops_them() {
        let (client, mut peer) = pair().await;
        assert!(delivered(&client), "nothing written yet");
        client.try_write(b"small").unwrap();
        assert!(delivered_within(&client, Duration::from_secs(5)).await, "5 bytes fit the peer's window");
        let mut five = [0u8; 5];
        peer.read_exact(&mut five).await.unwrap();
        // More than the peer's window: the rest waits in our queue.
        let big = vec![b'x'; 400_000];
        let mut written = 0;
        while written < big.len() {
            match client.try_write(&big[written..]) {
                Ok(n) => written += n,
                Err(_) => break,
            }
        }
        assert!(written > 100_000, "the send queue took {written} bytes");
        assert!(!delivered_within(&client, Duration::from_millis(200)).await);
        reset(&client);
        let mut got = 0usize;
        let mut buf = vec![0u8; 65536];
        loop {
            match tokio::time::timeout(Duration::from_secs(5), peer.read(&mut buf)).await.unwrap() {
                Ok(0) | Err(_) => break,
                Ok(n) => got += n,
            }
        }
        assert!(got < written / 2, "the reset dropped the queue: the peer got {got} of {written} bytes");
        assert!(client.try_write(b"more").is_err(), "a reset connection takes no more bytes");
        drop(peer);
        let mut sink = TcpStream::from_std(client.into_std().unwrap()).unwrap();
        assert!(sink.write_all(b"x").await.is_err());
    }
}
