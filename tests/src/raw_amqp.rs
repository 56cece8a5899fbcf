//! A hand-written AMQP 0-9-1 publisher, for deliveries no client library would encode: short
//! strings that are not UTF-8, header tables nested thousands of levels deep, unknown field types.
//! It speaks just enough of the protocol to publish with confirms: protocol header,
//! Start-Ok (PLAIN), Tune-Ok, Open, Channel.Open, Confirm.Select, then Basic.Publish with a
//! content header and a body frame, and waits for the broker's Basic.Ack.

use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const FRAME_METHOD: u8 = 1;
const FRAME_HEADER: u8 = 2;
const FRAME_BODY: u8 = 3;
const FRAME_HEARTBEAT: u8 = 8;
const FRAME_END: u8 = 0xCE;
const TIMEOUT: Duration = Duration::from_secs(30);

/// Raw bytes of the properties a test sets (each `None` is absent). Short strings are given as
/// bytes, so they need not be UTF-8; `headers` is a whole encoded field table (see [`table`]).
#[derive(Debug, Clone, Default)]
pub struct RawProperties {
    pub content_type: Option<Vec<u8>>,
    pub headers: Option<Vec<u8>>,
    pub delivery_mode: Option<u8>,
    pub message_id: Option<Vec<u8>>,
    pub kind: Option<Vec<u8>>,
}

impl RawProperties {
    fn encode(&self) -> Vec<u8> {
        let mut flags: u16 = 0;
        let mut out = Vec::new();
        if let Some(ct) = &self.content_type {
            flags |= 1 << 15;
            short(&mut out, ct);
        }
        if let Some(h) = &self.headers {
            flags |= 1 << 13;
            out.extend_from_slice(h);
        }
        if let Some(dm) = self.delivery_mode {
            flags |= 1 << 12;
            out.push(dm);
        }
        if let Some(id) = &self.message_id {
            flags |= 1 << 7;
            short(&mut out, id);
        }
        if let Some(t) = &self.kind {
            flags |= 1 << 5;
            short(&mut out, t);
        }
        let mut all = flags.to_be_bytes().to_vec();
        all.extend(out);
        all
    }
}

/// A short string: length byte, then the bytes (at most 255, not checked: tests may lie).
pub fn short(out: &mut Vec<u8>, s: &[u8]) {
    out.push(s.len() as u8);
    out.extend_from_slice(s);
}

/// An encoded field table (length prefix included) of `(name bytes, encoded value)` entries; an
/// encoded value is its type byte then its bytes (see [`long_string`], [`nested_table`]).
pub fn table(entries: &[(&[u8], Vec<u8>)]) -> Vec<u8> {
    let mut body = Vec::new();
    for (name, value) in entries {
        short(&mut body, name);
        body.extend_from_slice(value);
    }
    let mut out = (body.len() as u32).to_be_bytes().to_vec();
    out.extend(body);
    out
}

/// An encoded long-string value (type `S`).
pub fn long_string(s: &[u8]) -> Vec<u8> {
    let mut out = vec![b'S'];
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s);
    out
}

/// An encoded table value (type `F`) nested `levels` deep: `{"k": {"k": ... {}}}`. Built from the
/// inside out in one buffer, in linear time.
pub fn nested_table(levels: usize) -> Vec<u8> {
    // Each level is: name "k" (2 bytes), type 'F' (1), length (4); innermost: 'F' + empty table.
    let mut out = Vec::with_capacity(levels * 7 + 5);
    out.push(b'F');
    for i in 0..levels.saturating_sub(1) {
        // The body of table `i` (0 outermost): one entry per level below it.
        let body = (levels - 1 - i) * 7;
        out.extend_from_slice(&(body as u32).to_be_bytes());
        out.extend_from_slice(&[1, b'k', b'F']);
    }
    out.extend_from_slice(&0u32.to_be_bytes());
    out
}

/// One connection and one confirming channel.
pub struct RawPublisher {
    stream: TcpStream,
    /// Tag of the next publish (confirm mode numbers them from 1).
    next_tag: u64,
    pub frame_max: u32,
}

/// What the broker answered to a publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Acked,
    Nacked,
    /// The broker closed the channel or connection: its reply text.
    Closed(String),
}

impl RawPublisher {
    /// Connects to `addr` (host:port) as `user`/`password` on vhost `/`.
    pub async fn connect(addr: &str, user: &str, password: &str) -> std::io::Result<Self> {
        let stream = tokio::time::timeout(TIMEOUT, TcpStream::connect(addr)).await??;
        let mut p = Self {
            stream,
            next_tag: 1,
            frame_max: 131_072,
        };
        p.stream.write_all(b"AMQP\x00\x00\x09\x01").await?;
        p.expect_method(0, 10, 10).await?; // Connection.Start
        let mut args = Vec::new();
        args.extend_from_slice(&0u32.to_be_bytes()); // client-properties: empty table
        short(&mut args, b"PLAIN");
        let response = format!("\0{user}\0{password}");
        args.extend_from_slice(&(response.len() as u32).to_be_bytes());
        args.extend_from_slice(response.as_bytes());
        short(&mut args, b"en_US");
        p.send_method(0, 10, 11, &args).await?;
        let tune = p.expect_method(0, 10, 30).await?; // Connection.Tune
        let channel_max = u16::from_be_bytes([tune[0], tune[1]]);
        let frame_max = u32::from_be_bytes([tune[2], tune[3], tune[4], tune[5]]);
        if frame_max != 0 {
            p.frame_max = frame_max;
        }
        let mut args = channel_max.to_be_bytes().to_vec();
        args.extend_from_slice(&p.frame_max.to_be_bytes());
        args.extend_from_slice(&0u16.to_be_bytes()); // no heartbeats
        p.send_method(0, 10, 31, &args).await?;
        let mut args = Vec::new();
        short(&mut args, b"/");
        short(&mut args, b"");
        args.push(0);
        p.send_method(0, 10, 40, &args).await?; // Connection.Open
        p.expect_method(0, 10, 41).await?;
        p.send_method(1, 20, 10, &[0]).await?; // Channel.Open
        p.expect_method(1, 20, 11).await?;
        p.send_method(1, 85, 10, &[0]).await?; // Confirm.Select
        p.expect_method(1, 85, 11).await?;
        Ok(p)
    }

    /// Publishes one message and waits for the broker's answer.
    pub async fn publish(
        &mut self,
        exchange: &str,
        routing_key: &[u8],
        properties: &RawProperties,
        body: &[u8],
    ) -> std::io::Result<Answer> {
        let mut args = 0u16.to_be_bytes().to_vec();
        short(&mut args, exchange.as_bytes());
        short(&mut args, routing_key);
        args.push(0); // not mandatory, not immediate
        self.send_method(1, 60, 40, &args).await?;
        let mut header = 60u16.to_be_bytes().to_vec();
        header.extend_from_slice(&0u16.to_be_bytes());
        header.extend_from_slice(&(body.len() as u64).to_be_bytes());
        header.extend(properties.encode());
        self.send_frame(FRAME_HEADER, 1, &header).await?;
        let chunk = (self.frame_max as usize).saturating_sub(8).max(1);
        for part in body.chunks(chunk) {
            self.send_frame(FRAME_BODY, 1, part).await?;
        }
        let tag = self.next_tag;
        self.next_tag += 1;
        loop {
            let (kind, channel, payload) = self.read_frame().await?;
            if kind != FRAME_METHOD || payload.len() < 4 {
                continue;
            }
            let class = u16::from_be_bytes([payload[0], payload[1]]);
            let method = u16::from_be_bytes([payload[2], payload[3]]);
            match (class, method) {
                (60, 80) | (60, 120) if payload.len() >= 12 => {
                    let acked = u64::from_be_bytes(payload[4..12].try_into().unwrap_or([0; 8]));
                    if acked >= tag {
                        return Ok(if method == 80 {
                            Answer::Acked
                        } else {
                            Answer::Nacked
                        });
                    }
                }
                (10, 50) | (20, 40) => {
                    let text_len = usize::from(*payload.get(6).unwrap_or(&0));
                    let text = payload.get(7..7 + text_len).unwrap_or(&[]);
                    let text = String::from_utf8_lossy(text).into_owned();
                    if class == 10 {
                        let _ = self.send_method(0, 10, 51, &[]).await;
                    } else {
                        let _ = self.send_method(channel, 20, 41, &[]).await;
                    }
                    return Ok(Answer::Closed(text));
                }
                _ => {}
            }
        }
    }

    async fn send_method(
        &mut self,
        channel: u16,
        class: u16,
        method: u16,
        args: &[u8],
    ) -> std::io::Result<()> {
        let mut payload = class.to_be_bytes().to_vec();
        payload.extend_from_slice(&method.to_be_bytes());
        payload.extend_from_slice(args);
        self.send_frame(FRAME_METHOD, channel, &payload).await
    }

    async fn send_frame(&mut self, kind: u8, channel: u16, payload: &[u8]) -> std::io::Result<()> {
        let mut frame = vec![kind];
        frame.extend_from_slice(&channel.to_be_bytes());
        frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        frame.extend_from_slice(payload);
        frame.push(FRAME_END);
        tokio::time::timeout(TIMEOUT, self.stream.write_all(&frame)).await?
    }

    async fn read_frame(&mut self) -> std::io::Result<(u8, u16, Vec<u8>)> {
        tokio::time::timeout(TIMEOUT, async {
            loop {
                let mut head = [0u8; 7];
                self.stream.read_exact(&mut head).await?;
                let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
                let mut payload = vec![0u8; size + 1];
                self.stream.read_exact(&mut payload).await?;
                payload.pop();
                if head[0] == FRAME_HEARTBEAT {
                    continue;
                }
                return Ok((head[0], u16::from_be_bytes([head[1], head[2]]), payload));
            }
        })
        .await?
    }

    /// Reads frames until the method `class.method` on `channel`; returns its arguments.
    async fn expect_method(
        &mut self,
        channel: u16,
        class: u16,
        method: u16,
    ) -> std::io::Result<Vec<u8>> {
        loop {
            let (kind, ch, payload) = self.read_frame().await?;
            if kind != FRAME_METHOD || ch != channel || payload.len() < 4 {
                continue;
            }
            let got = (
                u16::from_be_bytes([payload[0], payload[1]]),
                u16::from_be_bytes([payload[2], payload[3]]),
            );
            if got == (class, method) {
                return Ok(payload[4..].to_vec());
            }
            return Err(std::io::Error::other(format!(
                "expected method {class}.{method}, got {}.{}: {:?}",
                got.0,
                got.1,
                String::from_utf8_lossy(&payload)
            )));
        }
    }

    /// Closes the connection politely.
    pub async fn close(mut self) {
        let mut args = 200u16.to_be_bytes().to_vec();
        short(&mut args, b"bye");
        args.extend_from_slice(&[0, 0, 0, 0]);
        if self.send_method(0, 10, 50, &args).await.is_ok() {
            let _ = self.expect_method(0, 10, 51).await;
        }
    }
}
