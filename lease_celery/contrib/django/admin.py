"""The admin pages of the lease store: leases, effect receipts (the reconcile queue is
their ``needs reconciliation`` filter), each key's history and the key-group limits.

Read-only views of the store's tables; every change is an action of :mod:`lease_celery.ops`
(``actions.py``) behind its own permission. Built for big tables: no page counts a whole
table (``BoundedPaginator``, no full result count, no facets), each filter is on an indexed
column or has fixed choices, and the key search is a range on the primary key.
"""

from __future__ import annotations

import time
from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from ...ops import LIMIT_KEY_PREFIX, Done, Operations
from ...stores.registry import shared_store
from . import actions
from .config import parse_url
from .models import HistoryEntry, Lease, LimitGroup, Receipt
from .paginator import BoundedPaginator

__all__ = ["HistoryAdmin", "LeaseAdmin", "LimitGroupAdmin", "ReceiptAdmin"]

#: The history entries a lease's page shows (the history page has them all).
HISTORY_ON_PAGE = 50


def moment(at: float | None) -> str:
    """An epoch time for people: UTC, and how long ago or ahead."""
    if at is None:
        return "–"
    delta = at - time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at))
    span = f"{abs(delta):.0f}s" if abs(delta) < 120 else f"{abs(delta) / 60:.0f}m"
    return f"{stamp} UTC ({'in ' + span if delta > 0 else span + ' ago'})"


def history_link(key: str, text: str = "history") -> str:
    return format_html('<a href="{}?{}">{}</a>',
                       reverse("admin:lease_celery_historyentry_changelist"),
                       urlencode({"key": key}), text)


class StoreAdmin(admin.ModelAdmin):
    """What every page shares: read-only, on the store's database, never counting it all."""

    show_full_result_count = False
    list_per_page = 50
    list_max_show_all = 50  # "show all" never offered: it would read the whole table
    show_facets = admin.ShowFacets.NEVER

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        alias = parse_url(actions.store_url())[0]
        return super().get_queryset(request).using(alias)

    def get_paginator(self, request: HttpRequest, queryset: Any, per_page: int,
                      orphans: int = 0, allow_empty_first_page: bool = True) -> Any:
        try:
            page = int(request.GET.get("p", 1))
        except ValueError:
            page = 1
        return BoundedPaginator(queryset, per_page, page_number=page, orphans=orphans,
                                allow_empty_first_page=allow_empty_first_page)

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Any],
                           search_term: str) -> tuple[QuerySet[Any], bool]:
        # Keys starting with the term: a range on the primary key's index (a LIKE or a
        # case-insensitive match would read every row).
        term = search_term.strip()
        if not term:
            return queryset, False
        return queryset.filter(pk__gte=term, pk__lt=term + "\U0010ffff"), False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def can(self, request: HttpRequest, codename: str) -> bool:
        return bool(request.user.has_perm(f"lease_celery.{codename}"))


class ByState(StoreAdmin):
    """A list with a state filter (leases, receipts): by key, the primary key's order,
    until a state is picked; then the newest first, the order of an index of that state by
    updated_at (the leases' partial ones, the receipts' state index), so that a page reads
    its own rows and no others. In key order a state has two costly plans: the primary key
    walked until a page of the state's rows turns up (a rare state: the whole table), or all
    of the state's rows read from its index and sorted (a common one)."""

    list_filter = ("state",)
    ordering = ("key",)

    def get_ordering(self, request: HttpRequest) -> Any:
        return ("-updated_at",) if "state__exact" in request.GET else self.ordering


def _lease_said(done: Done) -> str:
    what = {"release": "released (ready again; its holder's result will be refused)",
            "cancel": "cancelled", "requeue": f"requeued ({done.outcome})"}[done.action]
    return f"{done.key}: {what}, token {done.token}"


@admin.register(Lease)
class LeaseAdmin(ByState):
    list_display = ("key", "state", "owner", "token", "attempts", "expires", "updated",
                    "reason", "history")
    search_fields = ("key",)  # (the search box; get_search_results reads the key's range)
    search_help_text = "keys starting with"
    actions = ("release", "requeue", "cancel")
    readonly_fields = ("key", "state", "owner", "token", "fence", "attempts", "takeovers",
                       "expires", "updated", "not_before", "reason", "cancel", "grp",
                       "settling", "task", "checkpoint", "result", "recent_history")
    fields = readonly_fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        # 'purged' rows are tombstones that keep a purged key's token: no lease to show.
        return super().get_queryset(request).exclude(state="purged")

    @admin.display(description="expires", ordering="expires_at")
    def expires(self, obj: Lease) -> str:
        return moment(obj.expires_at) if obj.state == "running" else "–"

    @admin.display(description="updated", ordering="updated_at")
    def updated(self, obj: Lease) -> str:
        return moment(obj.updated_at)

    @admin.display(description="history")
    def history(self, obj: Lease) -> str:
        return history_link(obj.key)

    @admin.display(description="history (newest first)")
    def recent_history(self, obj: Lease) -> str:
        entries = shared_store(actions.store_url()).history(obj.key, limit=HISTORY_ON_PAGE)
        rows = format_html_join("", "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                                ((moment(e.at), e.event, e.token, e.detail or "")
                                 for e in reversed(entries)))
        return format_html("<table><tr><th>at</th><th>event</th><th>token</th>"
                           "<th>detail</th></tr>{}</table>{}", rows,
                           history_link(obj.key, "all of it"))

    def has_release_permission(self, request: HttpRequest) -> bool:
        return self.can(request, "release_lease")

    def has_requeue_permission(self, request: HttpRequest) -> bool:
        return self.can(request, "requeue_lease")

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return self.can(request, "cancel_lease")

    @admin.action(description="Release the selected running leases", permissions=["release"])
    def release(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        return actions.run_action(
            self, request, queryset, action="release", title="Release",
            form_class=actions.ReasonForm, said=_lease_said,
            perform=lambda ops, key, data: ops.release(
                key, reason=data["reason"] or "released from the Django admin"))

    @admin.action(description="Requeue the selected dead leases", permissions=["requeue"])
    def requeue(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        return actions.run_action(
            self, request, queryset, action="requeue", title="Requeue",
            form_class=actions.ReasonForm, said=_lease_said,
            perform=lambda ops, key, data: ops.requeue(
                key, reason=data["reason"] or "requeued from the Django admin"))

    @admin.action(description="Cancel the selected leases", permissions=["cancel"])
    def cancel(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        return actions.run_action(
            self, request, queryset, action="cancel", title="Cancel",
            form_class=actions.ReasonForm, said=_lease_said,
            perform=lambda ops, key, data: ops.cancel(
                key, reason=data["reason"] or "cancelled from the Django admin"))


def _receipt_said(done: Done) -> str:
    if done.action == "resolve":
        return f"{done.effect_key}: resolved (it happened); replays return {done.result!r}"
    return f"{done.effect_key}: discarded (it did not happen); the next attempt performs it"


@admin.register(Receipt)
class ReceiptAdmin(ByState):
    list_display = ("key", "state", "lease_key", "lease_token", "attempts", "started",
                    "updated")
    search_fields = ("key",)
    search_help_text = "receipt keys starting with"
    actions = ("resolve", "discard")
    readonly_fields = ("key", "state", "fingerprint", "lease_key", "lease_token",
                       "lease_owner", "attempts", "started", "updated", "result")
    fields = readonly_fields

    @admin.display(description="started", ordering="started_at")
    def started(self, obj: Receipt) -> str:
        return moment(obj.started_at)

    @admin.display(description="updated", ordering="updated_at")
    def updated(self, obj: Receipt) -> str:
        return moment(obj.updated_at)

    def has_resolve_permission(self, request: HttpRequest) -> bool:
        return self.can(request, "resolve_receipt")

    def has_discard_permission(self, request: HttpRequest) -> bool:
        return self.can(request, "discard_receipt")

    @admin.action(description="Resolve: the action happened", permissions=["resolve"])
    def resolve(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        return actions.run_action(
            self, request, queryset, action="resolve", title="Resolve",
            form_class=actions.ResultForm, said=_receipt_said,
            perform=lambda ops, key, data: ops.resolve(key, data["result"]))

    @admin.action(description="Discard: the action did not happen", permissions=["discard"])
    def discard(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        return actions.run_action(
            self, request, queryset, action="discard", title="Discard",
            form_class=actions.NoForm, said=_receipt_said,
            perform=lambda ops, key, data: ops.discard(key))


@admin.register(HistoryEntry)
class HistoryAdmin(StoreAdmin):
    list_display = ("key_link", "when", "event", "owner", "token", "fence", "detail")
    search_fields = ("key",)
    search_help_text = "entries of the key (exactly)"
    ordering = ("-id",)
    readonly_fields = ("key", "when", "event", "owner", "token", "fence", "detail")
    fields = readonly_fields

    def get_ordering(self, request: HttpRequest) -> Any:
        # One key's entries: read in time order from the (key, at) index.
        return ("-at", "-id") if "key" in request.GET else ("-id",)

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Any],
                           search_term: str) -> tuple[QuerySet[Any], bool]:
        term = search_term.strip()
        return (queryset.filter(key=term) if term else queryset), False

    @admin.display(description="key")
    def key_link(self, obj: HistoryEntry) -> str:
        return format_html('<a href="{}">{}</a>', reverse(
            "admin:lease_celery_lease_change", args=[obj.key]), obj.key)

    @admin.display(description="at", ordering="at")
    def when(self, obj: HistoryEntry) -> str:
        return moment(obj.at)


def _limit_said(done: Done) -> str:
    return f"{done.key.removeprefix(LIMIT_KEY_PREFIX)}: {done.detail}"


@admin.register(LimitGroup)
class LimitGroupAdmin(StoreAdmin):
    list_display = ("grp", "limit", "rate", "slots", "updated", "history")
    search_fields = ("grp",)
    search_help_text = "groups starting with"
    ordering = ("grp",)
    actions = ("change_limit",)
    readonly_fields = ("grp", "task_limit", "set_limit", "task_rate", "set_rate", "slots",
                       "updated")
    fields = readonly_fields

    @admin.display(description="limit")
    def limit(self, obj: LimitGroup) -> str:
        return _effective(obj.set_limit, obj.task_limit, lifted=0)

    @admin.display(description="rate")
    def rate(self, obj: LimitGroup) -> str:
        return _effective(obj.set_rate, obj.task_rate, lifted="")

    @admin.display(description="updated", ordering="updated_at")
    def updated(self, obj: LimitGroup) -> str:
        return moment(obj.updated_at)

    @admin.display(description="history")
    def history(self, obj: LimitGroup) -> str:
        return history_link(LIMIT_KEY_PREFIX + obj.grp)

    def has_set_limit_permission(self, request: HttpRequest) -> bool:
        return self.can(request, "set_limit")

    @admin.action(description="Change the limit of the selected groups",
                  permissions=["set_limit"])
    def change_limit(self, request: HttpRequest,
                     queryset: QuerySet[Any]) -> HttpResponse | None:
        return actions.run_action(
            self, request, queryset, action="change_limit", title="Change the limit",
            form_class=actions.LimitForm, said=_limit_said, perform=_set_limit)


def _set_limit(ops: Operations, group: str, data: dict[str, Any]) -> Done:
    return ops.limit(group, concurrency=data["concurrency"], rate=data["rate"],
                     reset=bool(data["reset"]))


def _effective(operator: Any, tasks: Any, *, lifted: Any) -> str:
    """The limit in force: the operator's (NULL: the tasks'; 0 or '': lifted)."""
    if operator is not None:
        return "none (lifted)" if operator == lifted else f"{operator} (operator's)"
    return "none" if tasks is None else f"{tasks} (tasks')"
