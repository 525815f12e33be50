//! Process-level behaviour: startup line and runtime driver (issue point 12: both drivers),
//! refusing a port that is already held.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::TcpListener;
use std::time::Duration;

use sluice_tests::*;

#[test]
fn startup_line_reports_the_driver_in_use() {
    let mock = Mock::start(&[]);
    let gw = Sluice::start(&Config::one_cluster(&mock).workers(2));
    assert_eq!(
        gw.startup.driver,
        expected_driver(),
        "startup line: {:?} (SLUICE_TEST_DRIVER={:?})",
        gw.startup.line,
        std::env::var("SLUICE_TEST_DRIVER").ok()
    );
    assert_eq!(gw.startup.workers, 2, "{}", gw.startup.line);
    assert!(gw.startup.addr.ip().is_loopback());
    assert_ne!(gw.startup.addr.port(), 0);
    // Both workers serve on the driver.
    for _ in 0..4 {
        assert_eq!(gw.chat(&chat_body("gpt-4o")).status, 200);
    }
}

#[test]
fn second_instance_on_the_same_port_refuses_to_start() {
    let mock = Mock::start(&[]);
    let first = Sluice::start(&Config::one_cluster(&mock));
    let addr = first.addr.to_string();
    let f = Sluice::try_start_within(
        &Config::one_cluster(&mock).listen(&addr),
        Duration::from_secs(5),
    )
    .err()
    .expect("a second sluice started on a port the first one holds");
    assert!(
        f.exited,
        "second sluice neither started nor exited within 5 s"
    );
    assert_ne!(f.code, Some(0), "{}", f.stderr);
    assert!(
        f.stderr.contains(&first.addr.port().to_string()),
        "the refusal should name the address: {:?}",
        f.stderr
    );
    // The first instance is unaffected and still owns every connection.
    for _ in 0..3 {
        assert_eq!(first.chat(&chat_body("gpt-4o")).status, 200);
    }
}

#[test]
fn port_held_by_another_program_refuses_to_start() {
    let mock = Mock::start(&[]);
    let holder = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = holder.local_addr().unwrap().to_string();
    let f = Sluice::try_start_within(
        &Config::one_cluster(&mock).listen(&addr),
        Duration::from_secs(5),
    )
    .err()
    .expect("sluice started on a port held by another listener");
    assert!(f.exited, "sluice neither started nor exited within 5 s");
    assert_ne!(f.code, Some(0), "{}", f.stderr);
    assert!(!f.stderr.trim().is_empty(), "no message on refusal");
    drop(holder);
}

#[test]
fn admin_port_held_by_another_program_is_named() {
    let mock = Mock::start(&[]);
    let holder = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = holder.local_addr().unwrap();
    let f = Sluice::try_start_within(
        &Config::one_cluster(&mock).set("admin", "listen", &toml_str(&addr.to_string())),
        Duration::from_secs(5),
    )
    .err()
    .expect("sluice started with its admin port held by another listener");
    assert!(f.exited, "sluice neither started nor exited within 5 s");
    assert_ne!(f.code, Some(0), "{}", f.stderr);
    assert!(
        f.stderr
            .contains(&format!("cannot bind admin listener {addr}: ")),
        "the failure should name the admin address: {:?}",
        f.stderr
    );
    drop(holder);
}
