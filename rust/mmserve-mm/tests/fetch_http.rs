//! fetch_bytes over real sockets on 127.0.0.1: the address guard, the streaming cap, redirects
//! and the overall deadline against a server that drips one byte at a time.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test fails loudly"
)]

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use mmserve_mm::source::fetch::{fetch_bytes, FetchPolicy};

/// Serves every connection on its own thread with `respond(path, stream)`; returns the port.
fn serve(respond: fn(&str, &mut TcpStream)) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            thread::spawn(move || {
                let mut stream = stream;
                let mut reader = BufReader::new(stream.try_clone().expect("clone"));
                let mut request_line = String::new();
                if reader.read_line(&mut request_line).is_err() {
                    return;
                }
                let mut header = String::new();
                while reader.read_line(&mut header).is_ok_and(|n| n > 2) {
                    header.clear();
                }
                let path = request_line.split(' ').nth(1).unwrap_or("/").to_string();
                respond(&path, &mut stream);
            });
        }
    });
    port
}

fn routes(path: &str, stream: &mut TcpStream) {
    let _ = match path {
        "/ok" => stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"),
        "/unsized" => {
            // No Content-Length: the body ends when the connection closes.
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n");
            stream.write_all(&[7u8; 4096])
        }
        "/to-localhost" => {
            let port = stream.local_addr().map(|a| a.port()).unwrap_or(0);
            let reply = format!(
                "HTTP/1.1 302 Found\r\nLocation: http://localhost:{port}/ok\r\nContent-Length: 0\r\n\r\n"
            );
            stream.write_all(reply.as_bytes())
        }
        "/drip" => {
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n");
            for _ in 0..1000 {
                if stream.write_all(b"x").is_err() {
                    break;
                }
                thread::sleep(Duration::from_millis(20));
            }
            Ok(())
        }
        _ => stream.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"),
    };
}

fn allowing_loopback() -> FetchPolicy {
    FetchPolicy {
        allowed_domains: vec!["127.0.0.1".to_string()],
        ..FetchPolicy::default()
    }
}

#[test]
fn loopback_needs_an_explicit_allowance() {
    let port = serve(routes);
    let url = format!("http://127.0.0.1:{port}/ok");
    let err = fetch_bytes(&url, &FetchPolicy::default()).unwrap_err();
    assert_eq!(err.code(), "fetch.forbidden_address");
    assert_eq!(fetch_bytes(&url, &allowing_loopback()).unwrap(), b"hello");
    let with_fragment = format!("{url}#part");
    assert_eq!(
        fetch_bytes(&with_fragment, &allowing_loopback()).unwrap(),
        b"hello"
    );
    let missing = format!("http://127.0.0.1:{port}/missing");
    let err = fetch_bytes(&missing, &allowing_loopback()).unwrap_err();
    assert_eq!(err.code(), "fetch.http_status");
}

#[test]
fn redirect_to_a_host_not_allowed_is_refused() {
    let port = serve(routes);
    let url = format!("http://127.0.0.1:{port}/to-localhost");
    let err = fetch_bytes(&url, &allowing_loopback()).unwrap_err();
    assert_eq!(err.code(), "fetch.forbidden_address");
    let both = FetchPolicy {
        allowed_domains: vec!["127.0.0.1".into(), "localhost".into()],
        ..FetchPolicy::default()
    };
    assert_eq!(fetch_bytes(&url, &both).unwrap(), b"hello");
}

#[test]
fn size_cap_holds_without_content_length() {
    let port = serve(routes);
    let url = format!("http://127.0.0.1:{port}/unsized");
    let exact = FetchPolicy {
        max_bytes: 4096,
        ..allowing_loopback()
    };
    assert_eq!(fetch_bytes(&url, &exact).unwrap().len(), 4096);
    let smaller = FetchPolicy {
        max_bytes: 4095,
        ..allowing_loopback()
    };
    assert_eq!(
        fetch_bytes(&url, &smaller).unwrap_err().code(),
        "fetch.too_large"
    );
}

#[test]
fn deadline_covers_a_body_that_never_finishes() {
    let port = serve(routes);
    let url = format!("http://127.0.0.1:{port}/drip");
    let policy = FetchPolicy {
        timeout: Duration::from_millis(700),
        ..allowing_loopback()
    };
    let started = Instant::now();
    let err = fetch_bytes(&url, &policy).unwrap_err();
    assert_eq!(err.code(), "fetch.timeout");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}
