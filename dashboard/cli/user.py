"""``clusterdx user add NAME``: a local account. The password is prompted for (twice) or read from a file, never
taken as an argument, where ``ps`` and the shell history would show it."""

from __future__ import annotations

import argparse
import getpass
import sys

from dashboard.cli import migrate, setup_django


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    # No abbreviations: "--password SECRET" must be an error, not "--password-file" reading a file named SECRET.
    add = sub.add_parser("add", help="create a user (password prompted, or --password-file)", allow_abbrev=False)
    add.add_argument("name")
    add.add_argument("--email", default="")
    add.add_argument("--password-file", metavar="F",
                     help="read the password from the first line of F ('-' for standard input)")
    add.add_argument("--superuser", action="store_true", help="an administrator: owner of every cluster")


def _password(args: argparse.Namespace) -> str:
    if args.password_file:
        with (sys.stdin if args.password_file == "-" else open(args.password_file, encoding="utf-8")) as f:
            return f.readline().rstrip("\r\n")
    first = getpass.getpass(f"Password for {args.name}: ")
    if getpass.getpass("Again: ") != first:
        raise ValueError("the passwords differ")
    return first


def main(args: argparse.Namespace) -> int:
    setup_django()
    migrate(verbose=False)  # the first admin is often made before the server ever started on this database
    from django.contrib.auth import get_user_model
    from django.contrib.auth.password_validation import validate_password
    from django.core.exceptions import ValidationError

    from dashboard.telemetry import audit

    users = get_user_model()
    if users.objects.filter(username=args.name).exists():
        print(f"error: user {args.name!r} exists")
        return 1
    try:
        users.username_validator(args.name)
        password = _password(args)
        if not password:
            raise ValueError("the password is empty")
        validate_password(password, users(username=args.name, email=args.email))
    except ValidationError as exc:
        print(f"error: {' '.join(exc.messages)}")
        return 2
    except (ValueError, OSError) as exc:
        print(f"error: {exc}")
        return 2
    make = users.objects.create_superuser if args.superuser else users.objects.create_user
    user = make(args.name, email=args.email, password=password)
    audit.record(audit.cli_actor(), "user.add", target=user.username, superuser=bool(args.superuser))
    print(f"created {'superuser' if args.superuser else 'user'} {user.username}")
    return 0
